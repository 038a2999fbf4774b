"""engine: trtllm-build where TensorRT-LLM is installed; elsewhere, the command to run."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, ClassVar

from ..core.errors import EngineError, SpecError
from ..core.stage import BuildContext, Stage, StageSkipped
from .build import build_command, build_engine, find_toolchain
from .host import local_gpus

NOT_INSTALLED = "TensorRT-LLM not installed"


class EngineStage(Stage):
    name: ClassVar[str] = "engine"
    version: ClassVar[int] = 1
    tools: ClassVar[tuple[str, ...]] = ("tensorrt-llm", "tensorrt")
    needs_verified_checkpoint: ClassVar[bool] = True

    def wanted(self, ctx: BuildContext, *, explicit: bool) -> bool:
        """Where the target builds an engine; asked for by name where it does not, refused
        with the target's words."""
        target = ctx.spec.build_target
        refusal = target.engine_refusal()
        if explicit and refusal:
            raise SpecError(refusal)
        return target.builds_engine

    def output_dir(self, ctx: BuildContext) -> Path:
        return ctx.layout.engine

    def inputs(self, ctx: BuildContext) -> dict[str, Path]:
        return {"checkpoint": ctx.layout.checkpoint}

    def params(self, ctx: BuildContext) -> dict[str, Any]:
        toolchain = find_toolchain()
        return {
            "argv": build_command(ctx.spec, Path("CHECKPOINT"), Path("OUTPUT"))[1:],
            "target_gpu": ctx.spec.target_gpu,
            "executable": toolchain.executable if toolchain else None,
            # An engine is specific to the GPU it is built on (SM) and to TensorRT's version.
            "build_gpus": local_gpus() if toolchain else [],
        }

    def run(self, ctx: BuildContext, work: Path) -> dict[str, Any]:
        toolchain = find_toolchain()
        checkpoint, engine = ctx.layout.checkpoint.resolve(), ctx.layout.engine.resolve()
        if toolchain is None:
            command = shlex.join(build_command(ctx.spec, checkpoint, engine))
            if ctx.spec.require_engine:
                raise EngineError(
                    f"{NOT_INSTALLED} and --require-engine is set: run on a GPU host with TensorRT-LLM: {command}"
                )
            raise StageSkipped(f"skipped: {NOT_INSTALLED}", {"command": command})
        details = build_engine(
            ctx.spec,
            toolchain,
            checkpoint,
            work,
            shown_output=engine,
            log=ctx.layout.variant_dir / "engine-build.log",
            checkpoint_digest=ctx.digests.digest(ctx.layout.checkpoint),
            digest=ctx.digests.file,
            on_phase=ctx.progress,
        )
        return {**details, "memory_plan": ctx.memory.to_json() if ctx.memory is not None else None}
