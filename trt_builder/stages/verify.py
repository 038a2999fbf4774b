"""verify: the checkpoint, run by the reference runtime, against transformers; gates apply."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar

from ..fsio import write_json
from ..gates import Gate, checkpoint_mode, gate_for
from .base import BuildContext


def _gate(ctx: BuildContext) -> Gate:
    """The gate of the checkpoint's mode (`auto` resolves to the dtype convert wrote)."""
    opts = ctx.spec.verify
    mode = ctx.spec.mode.name
    if (ctx.layout.checkpoint / "config.json").is_file():
        mode = checkpoint_mode(ctx.layout.checkpoint)
    return gate_for(mode, min_top1=opts.min_top1, max_kl=opts.max_kl)


class VerifyStage:
    name: ClassVar[str] = "verify"
    version: ClassVar[int] = 1
    tools: ClassVar[tuple[str, ...]] = ("torch", "transformers")
    code: ClassVar[tuple[str, ...]] = (
        "verify.py",
        "gates.py",
        "parallel.py",
        "runtime/reference.py",
        "data/prompts.json",
    )

    def output_dir(self, ctx: BuildContext) -> Path:
        return ctx.layout.reports

    def inputs(self, ctx: BuildContext) -> dict[str, Path]:
        return {"checkpoint": ctx.layout.checkpoint, "hf": ctx.layout.hf}

    def params(self, ctx: BuildContext) -> dict[str, Any]:
        return {
            "gate": asdict(_gate(ctx)),
            "max_new_tokens": ctx.spec.verify.max_new_tokens,
            "device": ctx.spec.verify.device,
        }

    def run(self, ctx: BuildContext, work: Path) -> dict[str, Any]:
        from ..verify import verify_checkpoint  # torch and transformers: only when it runs

        report = verify_checkpoint(
            ctx.layout.checkpoint,
            ctx.layout.hf,
            gate=_gate(ctx),
            max_new_tokens=ctx.spec.verify.max_new_tokens,
            device=ctx.spec.verify.device,
        )
        write_json(work / "verify.json", report)
        summary = {
            k: report[k]
            for k in ("passed", "failures", "top1", "kl_mean", "greedy_agreement", "device")
        }
        return {**summary, "failed": not report["passed"]}
