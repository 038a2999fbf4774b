"""convert: HF directory -> this variant's checkpoint: TensorRT-LLM's (the engine target) or the
Hugging Face one TensorRT-LLM's PyTorch backend loads (the llmapi target)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from ..checkpoint.weights import weight_files
from ..core.rooms import load_rooms
from ..core.stage import BuildContext, Stage
from ..recipe.candidates import recipe_dir, recipe_input, searches
from ..source.twin import calibration_dir, quantized_source
from .dispatch import checkpoint_writer


def fetched(hf: Path) -> bool:
    """Whether fetch has written `hf` (a dry run, or a plan before fetch, finds it empty)."""
    return any(hf.glob("*.safetensors"))


class ConvertStage(Stage):
    name: ClassVar[str] = "convert"
    version: ClassVar[int] = 1
    tools: ClassVar[tuple[str, ...]] = ("torch", "safetensors")

    def output_dir(self, ctx: BuildContext) -> Path:
        return ctx.layout.checkpoint

    def inputs(self, ctx: BuildContext) -> dict[str, Path]:
        hf = quantized_source(ctx)  # config and weights only: a tokenizer change does not reconvert
        index = hf / "model.safetensors.index.json"
        inputs = {  # what convert reads: the weight files the index lists, else every one
            "hf/config.json": hf / "config.json",
            **({f"hf/{index.name}": index} if index.is_file() else {}),
            **{f"hf/{p.name}": p for p in (weight_files(hf) if fetched(hf) else [])},
        }
        if ctx.spec.mode.needs_calibration:
            inputs["calibration"] = self._calibration(ctx) / "calibration.safetensors"
        recipe = recipe_input(ctx)
        if recipe is not None:
            inputs["recipe"] = recipe
        return inputs

    def _calibration(self, ctx: BuildContext) -> Path:
        return calibration_dir(ctx)

    def params(self, ctx: BuildContext) -> dict[str, Any]:
        return ctx.spec.build_target.convert_params(ctx.spec)

    def run(self, ctx: BuildContext, work: Path) -> dict[str, Any]:
        mode = ctx.spec.mode
        calibration = self._calibration(ctx) if mode.needs_calibration else None
        recipe = recipe_dir(ctx) / "recipe.json" if searches(ctx) else None
        load_rooms("targets", "convert")  # torch: only when it runs
        return checkpoint_writer(ctx.spec.build_target, mode, quantized_source(ctx), work,
                                 tp=ctx.spec.tp, pp=ctx.spec.pp, calibration=calibration,
                                 recipe=recipe, remember=ctx.digests.remember)  # fmt: skip
