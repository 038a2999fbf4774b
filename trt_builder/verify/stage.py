"""verify: the checkpoint, run by the checkpoint runtime, against transformers; gates apply."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar

from ..core.fsio import write_json
from ..core.stage import BuildContext, Stage
from ..modes import checkpoint_mode
from ..spec.gates import Gate
from .reports import write_reports


def _gate(ctx: BuildContext) -> Gate:
    """The gate of the checkpoint's mode (`auto` resolves to the dtype convert wrote)."""
    opts = ctx.spec.verify
    mode = ctx.spec.mode.name
    if (ctx.layout.checkpoint / "config.json").is_file():
        mode = checkpoint_mode(ctx.layout.checkpoint)
    return opts.gate(mode)


class VerifyStage(Stage):
    name: ClassVar[str] = "verify"
    version: ClassVar[int] = 1
    tools: ClassVar[tuple[str, ...]] = ("torch", "transformers")

    def output_dir(self, ctx: BuildContext) -> Path:
        return ctx.layout.reports

    def inputs(self, ctx: BuildContext) -> dict[str, Path]:
        return {"checkpoint": ctx.layout.checkpoint, "hf": ctx.layout.hf}

    def params(self, ctx: BuildContext) -> dict[str, Any]:
        return {
            "gate": asdict(_gate(ctx)),
            "max_new_tokens": ctx.spec.verify.max_new_tokens,
            "heldout_tokens": ctx.spec.verify.heldout_tokens,
            "device": ctx.spec.verify.device,
        }

    def run(self, ctx: BuildContext, work: Path) -> dict[str, Any]:
        from .compare import record_summary, verify_checkpoint  # torch: only when it runs

        report = verify_checkpoint(
            ctx.layout.checkpoint,
            ctx.layout.hf,
            gate=_gate(ctx),
            max_new_tokens=ctx.spec.verify.max_new_tokens,
            heldout_tokens=ctx.spec.verify.heldout_tokens,
            device=ctx.spec.verify.device,
        )
        write_json(work / "verify.json", report)
        write_reports(report, work)
        return {**record_summary(report), "failed": not report["passed"]}
