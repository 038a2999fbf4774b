"""package: the Triton model repository, validated against Triton's ModelConfig schema and
published as a new version (what it ships: package.py)."""

from __future__ import annotations

import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar

from ..core.stage import BuildContext, Stage
from .llmapi import MODEL, TEMPLATE, trtllm_serve_command, write_llmapi_repository
from .llmapi import REFERENCE as LLMAPI_REFERENCE
from .package import backend, llmapi_options, repository_options, shipped_engine, tokenizer_files
from .repository import INFO, REFERENCE, next_version, publish, write_repository


class PackageStage(Stage):
    name: ClassVar[str] = "package"
    version: ClassVar[int] = 2
    tools: ClassVar[tuple[str, ...]] = ("tritonclient", "transformers")
    needs_verified_checkpoint: ClassVar[bool] = True
    publishes: ClassVar[bool] = True

    def output_dir(self, ctx: BuildContext) -> Path:
        return ctx.layout.triton

    def inputs(self, ctx: BuildContext) -> dict[str, Path]:
        if ctx.spec.target == "llmapi":  # the checkpoint holds its tokenizer
            return {"checkpoint": ctx.layout.checkpoint}
        found = {f"hf/{p.name}": p for p in tokenizer_files(ctx)}
        found["checkpoint/config.json"] = ctx.layout.checkpoint / "config.json"
        engine = shipped_engine(ctx)
        if backend(ctx, engine) == "reference":  # it ships the checkpoint itself
            found["checkpoint"] = ctx.layout.checkpoint
        if engine is not None:
            found["engine"] = engine
        return found

    def params(self, ctx: BuildContext) -> dict[str, Any]:
        # Version 0 stands for whichever version is published next: not part of the key.
        if ctx.spec.target == "llmapi":
            return {"llmapi": asdict(llmapi_options(ctx, 0))}
        return {"options": asdict(repository_options(ctx, 0, shipped_engine(ctx)))}

    def run(self, ctx: BuildContext, work: Path) -> dict[str, Any]:
        if ctx.spec.target == "llmapi":
            return self._llmapi(ctx, work)
        engine = shipped_engine(ctx)
        version = next_version(ctx.layout.triton)
        options = repository_options(ctx, version, engine)
        reference = options.backend == "reference"
        write_repository(work, options, tokenizer_files(ctx), engine,
                         ctx.layout.checkpoint if reference else None)  # fmt: skip
        note = None
        if reference:
            note = f"tensorrt_llm runs on the {REFERENCE}: serve it anywhere (trt-builder serve)"
        elif engine is None:
            note = "no engine yet: build it on a GPU host, then rerun package"
        return {
            "models": sorted(p.parent.name for p in work.glob("*/config.pbtxt")),
            "version": version,
            "backend": options.backend,
            "engine_included": engine is not None and not reference,
            "note": note,
        }

    def _llmapi(self, ctx: BuildContext, work: Path) -> dict[str, Any]:
        options = llmapi_options(ctx, next_version(ctx.layout.triton))
        write_llmapi_repository(work, options, ctx.layout.checkpoint, INFO)
        return {
            "command": shlex.join(trtllm_serve_command(options)),
            "models": [MODEL],
            "version": options.version,
            "backend": options.backend,
            "target": "llmapi",
            "engine_included": False,
            "note": f"tensorrt_llm (llmapi) runs on the {LLMAPI_REFERENCE}: serve it anywhere "
            "(trt-builder serve)"
            if options.backend == "reference"
            else "tensorrt_llm (llmapi) "
            f"runs TensorRT-LLM's own model.py, linked from {TEMPLATE} (the NGC container's "
            "template): serve it in that container",
        }

    def place(self, ctx: BuildContext, work: Path, link: Path) -> None:
        """Publish `work` as the next version and switch the repository link to it, keeping
        the newest [triton] keep versions."""
        removed = publish(work, link, keep=ctx.spec.triton.keep)
        if removed:
            ctx.notices.append(
                f"removed Triton repository version(s) {removed} (keep {ctx.spec.triton.keep})"
            )
