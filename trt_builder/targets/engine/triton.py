"""The engine target's Triton repository: tensorrtllm_backend's inflight_batcher_llm layout
(triton/repository.py writes and checks it; triton/package.py chooses what it ships), the
engine on NVIDIA's tensorrtllm backend or the checkpoint on the reference backend."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from ...core.stage import BuildContext
from ...triton.kinds import Packager, RepositoryKind, packager, register_kind
from ...triton.package import backend, repository_options, shipped_engine, tokenizer_files
from ...triton.repository import (
    REFERENCE,
    check_repository,
    next_version,
    served_models,
    write_repository,
)
from .spec import EngineTarget


class EnginePackager(Packager):
    """The ensemble of preprocessing, tensorrt_llm and postprocessing (a BLS model), its
    tokenizer, and the engine or, on the reference backend, the checkpoint."""

    def inputs(self, ctx: BuildContext) -> dict[str, Path]:
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
        return {"options": asdict(repository_options(ctx, 0, shipped_engine(ctx)))}

    def run(self, ctx: BuildContext, work: Path) -> dict[str, Any]:
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


packager.register(EngineTarget)(lambda target: EnginePackager())


def _no_check(root: Path) -> None:
    """Any host with a tritonserver serves it (the reference backend anywhere; the engine where
    the tensorrtllm backend is, which the server itself says)."""


register_kind(RepositoryKind(
    target=EngineTarget,
    claims=lambda configs: True,  # the default: assumed where no other kind claims one
    validate=check_repository,
    models=served_models,
    tokenizer=lambda root: root / "preprocessing" / "tokenizer",
    check_host=_no_check,
))  # fmt: skip
