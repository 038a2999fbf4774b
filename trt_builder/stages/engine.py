"""engine: trtllm-build where TensorRT-LLM is installed; elsewhere, the command to run."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any, ClassVar

from ..engine import (
    RELEASES,
    build_command,
    check_gemm_plugin,
    check_release,
    find_toolchain,
    local_gpus,
    release_for,
    run_build,
    write_engine_manifest,
)
from ..errors import EngineError
from .base import BuildContext, StageSkipped

NOT_INSTALLED = "TensorRT-LLM not installed"


class EngineStage:
    name: ClassVar[str] = "engine"
    version: ClassVar[int] = 1
    tools: ClassVar[tuple[str, ...]] = ("tensorrt-llm", "tensorrt")
    needs_verified_checkpoint: ClassVar[bool] = True
    code: ClassVar[tuple[str, ...]] = ("engine.py",)

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
        command = shlex.join(
            build_command(ctx.spec, ctx.layout.checkpoint.resolve(), ctx.layout.engine.resolve())
        )
        if toolchain is None:
            if ctx.spec.require_engine:
                raise EngineError(
                    f"{NOT_INSTALLED} and --require-engine is set: run on a GPU host with TensorRT-LLM: {command}"
                )
            raise StageSkipped(f"skipped: {NOT_INSTALLED}", {"command": command})
        config = json.loads((ctx.layout.checkpoint / "config.json").read_text())
        check_release(config["architecture"], toolchain.trtllm_version)
        check_gemm_plugin(ctx.spec.engine.gemm_plugin, config["dtype"])
        release = (
            RELEASES[-1]
            if toolchain.trtllm_version == "absent"
            else release_for(toolchain.trtllm_version)
        )
        argv = build_command(
            ctx.spec,
            ctx.layout.checkpoint.resolve(),
            work,
            executable=toolchain.executable,
            release=release,
        )
        log = ctx.layout.variant_dir / "engine-build.log"
        build = run_build(argv, log, timeout_s=ctx.spec.engine.timeout_s, on_phase=ctx.progress)
        if not list(work.glob("rank*.engine")):
            raise EngineError(
                f"trtllm-build finished but wrote no rank*.engine into the output; see {log}"
            )
        write_engine_manifest(
            work,
            argv=argv,
            trtllm_version=toolchain.trtllm_version,
            checkpoint_digest=ctx.digests.digest(ctx.layout.checkpoint),
            digest=ctx.digests.file,
        )
        return {
            "command": command,
            "executed": shlex.join(argv),
            "executable": toolchain.executable,
            "build_gpus": local_gpus(),
            "tensorrt_llm": toolchain.trtllm_version,
            "build_seconds": round(build.seconds, 1),
            "phases": [{"phase": phase, "at_s": at} for phase, at in build.phases],
            "log": str(log),
            "memory_plan": ctx.memory.to_json() if ctx.memory is not None else None,
        }
