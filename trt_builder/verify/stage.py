"""verify: the checkpoint, run by the checkpoint runtime (or by vLLM: verify.runtime), against
transformers; gates apply."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar

from ..core.fsio import write_json
from ..core.records import Records, model_records
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
        runtime = ctx.spec.verify.runtime
        return {
            "gate": asdict(_gate(ctx)),
            "max_new_tokens": ctx.spec.verify.max_new_tokens,
            "heldout_tokens": ctx.spec.verify.heldout_tokens,
            "device": ctx.spec.verify.device,
            # a serving runtime's release is part of what is verified (the checkpoint
            # runtime's code is in the key already); absent for it, so its keys stay as they were
            **(
                {"runtime": runtime, "release": _release(runtime)} if runtime != "reference" else {}
            ),  # fmt: skip
        }

    def run(self, ctx: BuildContext, work: Path) -> dict[str, Any]:
        from .compare import record_summary, verify_checkpoint  # torch: only when it runs

        runtime = ctx.spec.verify.runtime
        report = verify_checkpoint(
            ctx.layout.checkpoint,
            ctx.layout.hf,
            gate=_gate(ctx),
            max_new_tokens=ctx.spec.verify.max_new_tokens,
            heldout_tokens=ctx.spec.verify.heldout_tokens,
            device=ctx.spec.verify.device,
            runtime=runtime,
            open_runtime=_opener(runtime, ctx.layout.checkpoint),
            records=_records(ctx),
        )
        write_json(work / "verify.json", report)
        write_reports(report, work)
        return {**record_summary(report), "failed": not report["passed"]}


def _records(ctx: BuildContext) -> Records:
    """The reference's outputs, kept for every variant of the model (reference.py), on the
    device verify runs it on."""
    from ..source.hf import pick_device
    from .reference import FORMAT

    return model_records(ctx, pick_device(ctx.spec.verify.device), FORMAT)


def _release(runtime: str) -> str | None:
    """The installed release of a serving runtime verify runs (vllm: its environment's)."""
    from ..runtimes.vllm import find_vllm, installed_version

    assert runtime == "vllm", runtime  # the runtimes a target takes (targets/: VERIFY_RUNTIMES)
    return installed_version(find_vllm())


def _opener(runtime: str, checkpoint: Path) -> Any:
    """How verify opens `runtime` on `checkpoint` (None: the checkpoint runtime, its own)."""
    if runtime == "reference":
        return None
    from ..runtimes.vllm import opener

    return opener(checkpoint)
