"""verify: the checkpoint, run by the reference runtime, against transformers; gates apply."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar

from ..fsio import write_json
from ..gates import Gate, checkpoint_mode
from .base import BuildContext


def _gate(ctx: BuildContext) -> Gate:
    """The gate of the checkpoint's mode (`auto` resolves to the dtype convert wrote)."""
    opts = ctx.spec.verify
    mode = ctx.spec.mode.name
    if (ctx.layout.checkpoint / "config.json").is_file():
        mode = checkpoint_mode(ctx.layout.checkpoint)
    return opts.gate(mode)


class VerifyStage:
    name: ClassVar[str] = "verify"
    version: ClassVar[int] = 1
    tools: ClassVar[tuple[str, ...]] = ("torch", "transformers")
    code: ClassVar[tuple[str, ...]] = (
        "verify.py",
        "diagnose.py",
        "reports.py",
        "gates.py",
        "parallel.py",
        "runtime/reference.py",
        "data/prompts.json",
        "data/corpus/heldout.jsonl",
    )

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
        from ..reports import write_reports
        from ..verify import verify_checkpoint  # torch and transformers: only when it runs

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
        summary = {
            k: report[k]
            for k in ("passed", "failures", "top1", "kl_mean", "greedy_agreement", "device")
        }
        summary["ppl_delta_pct"] = (report.get("perplexity") or {}).get("delta_pct")
        summary["likely_cause"] = next(
            (d["cause"] for d in report["diagnosis"] if d["fatal"]),
            report["diagnosis"][0]["cause"] if report["diagnosis"] else None,
        )
        return {**summary, "failed": not report["passed"]}
