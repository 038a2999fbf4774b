"""convert: HF directory -> TensorRT-LLM checkpoint for this variant."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from .base import BuildContext


class ConvertStage:
    name: ClassVar[str] = "convert"
    version: ClassVar[int] = 1
    tools: ClassVar[tuple[str, ...]] = ("torch", "safetensors")
    code: ClassVar[tuple[str, ...]] = (
        "convert.py",
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
        return {
            "hf/config.json": hf / "config.json",
            **{f"hf/{p.name}": p for p in sorted(hf.glob("*.safetensors"))},
        }

    def params(self, ctx: BuildContext) -> dict[str, Any]:
        return {"mode": ctx.spec.mode.to_json(), "tp": ctx.spec.tp, "pp": ctx.spec.pp}

    def run(self, ctx: BuildContext, work: Path) -> dict[str, Any]:
        from ..convert import convert_checkpoint  # torch: only when it runs

        return convert_checkpoint(
            ctx.layout.hf, work, ctx.spec.mode, tp=ctx.spec.tp, pp=ctx.spec.pp
        )
