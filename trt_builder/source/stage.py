"""fetch: the model as an HF safetensors directory, shared by every variant of a revision."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from ..core.stage import BuildContext, Stage
from .fetch import fetch_model
from .files import model_files


class FetchStage(Stage):
    name: ClassVar[str] = "fetch"
    version: ClassVar[int] = 1
    tools: ClassVar[tuple[str, ...]] = (
        "torch",
        "transformers",
        "gguf",
        "safetensors",
        "huggingface-hub",
    )

    def output_dir(self, ctx: BuildContext) -> Path:
        return ctx.layout.hf

    def inputs(self, ctx: BuildContext) -> dict[str, Path]:
        # A hub model's input is its commit sha (a parameter); local inputs are hashed.
        ref = Path(ctx.source.ref)
        if ctx.source.kind == "local":
            return {f"model/{p.name}": p for p in model_files(ref)}
        return {} if ctx.source.kind == "hub" else {"model": ref}

    def params(self, ctx: BuildContext) -> dict[str, Any]:
        return {
            "kind": ctx.source.kind,
            "revision": ctx.source.revision,
            "repo": ctx.source.ref if ctx.source.kind == "hub" else None,
            "allow_pickle": ctx.spec.allow_pickle,
        }

    def run(self, ctx: BuildContext, work: Path) -> dict[str, Any]:
        return fetch_model(ctx.source, work, allow_pickle=ctx.spec.allow_pickle,
                           offline=ctx.offline, digests=ctx.digests)  # fmt: skip
