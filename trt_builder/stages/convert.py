"""convert: HF directory -> TensorRT-LLM checkpoint for this variant."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from ..fsio import write_json
from .base import BuildContext


class ConvertStage:
    name: ClassVar[str] = "convert"
    version: ClassVar[int] = 1
    tools: ClassVar[tuple[str, ...]] = ("torch", "safetensors")
    code: ClassVar[tuple[str, ...]] = (
        "convert.py",
        "smoothquant.py",
        "recipe.py",
        "kvcache.py",
        "runtime/reference.py",
        "data/corpus/search.jsonl",
        "calibrate.py",
        "fetch.py",
        "quant.py",
        "parallel.py",
        "safetensors_io.py",
        "models/*.py",
    )

    def output_dir(self, ctx: BuildContext) -> Path:
        return ctx.layout.checkpoint

    def inputs(self, ctx: BuildContext) -> dict[str, Path]:
        hf = ctx.layout.hf  # config and weights only: a tokenizer change does not reconvert
        inputs = {
            "hf/config.json": hf / "config.json",
            **{f"hf/{p.name}": p for p in sorted(hf.glob("*.safetensors"))},
        }
        if ctx.spec.mode.needs_calibration:
            inputs["calibration"] = self._calibration(ctx) / "calibration.safetensors"
        return inputs

    def _calibration(self, ctx: BuildContext) -> Path:
        return ctx.layout.calibration(ctx.spec.calibrate.slug())

    def params(self, ctx: BuildContext) -> dict[str, Any]:
        return {"mode": ctx.spec.mode.to_json(), "tp": ctx.spec.tp, "pp": ctx.spec.pp}

    def run(self, ctx: BuildContext, work: Path) -> dict[str, Any]:
        from ..quant import SmoothQuant

        mode = ctx.spec.mode
        if isinstance(mode, SmoothQuant):
            from ..smoothquant import convert_smoothquant  # torch: only when it runs

            recipe, per_layer = None, None
            if mode.alpha is None:  # the recipe search picks it
                from ..recipe import search_recipe

                alpha, per_layer, recipe = search_recipe(
                    ctx.layout.hf, work, mode, self._calibration(ctx)
                )
                mode = replace(mode, alpha=alpha)
            summary = convert_smoothquant(
                ctx.layout.hf,
                work,
                mode,
                self._calibration(ctx),
                tp=ctx.spec.tp,
                pp=ctx.spec.pp,
                alphas=per_layer,
            )
            if recipe is not None:
                write_json(work / "recipe.json", recipe)  # trtllm-build reads only its own files
                summary["recipe"] = recipe
            return summary
        from ..convert import convert_checkpoint

        calibration = self._calibration(ctx) if mode.needs_calibration else None
        return convert_checkpoint(
            ctx.layout.hf, work, mode, tp=ctx.spec.tp, pp=ctx.spec.pp, calibration=calibration
        )
