"""package: the Triton model repository of the build's target (each target's room writes its
own: targets/<target>/triton.py), validated against Triton's ModelConfig schema and published
as a new version."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from ..core.rooms import load_rooms
from ..core.stage import BuildContext, Stage
from .kinds import Packager, packager
from .repository import publish


def _packager(ctx: BuildContext) -> Packager:
    load_rooms("targets", "triton")
    return packager(ctx.spec.build_target)


class PackageStage(Stage):
    name: ClassVar[str] = "package"
    version: ClassVar[int] = 2
    tools: ClassVar[tuple[str, ...]] = ("tritonclient", "transformers")
    needs_verified_checkpoint: ClassVar[bool] = True
    publishes: ClassVar[bool] = True

    def output_dir(self, ctx: BuildContext) -> Path:
        return ctx.layout.triton

    def inputs(self, ctx: BuildContext) -> dict[str, Path]:
        return _packager(ctx).inputs(ctx)

    def params(self, ctx: BuildContext) -> dict[str, Any]:
        return _packager(ctx).params(ctx)

    def run(self, ctx: BuildContext, work: Path) -> dict[str, Any]:
        return _packager(ctx).run(ctx, work)

    def place(self, ctx: BuildContext, work: Path, link: Path) -> None:
        """Publish `work` as the next version and switch the repository link to it, keeping
        the newest [triton] keep versions."""
        removed = publish(work, link, keep=ctx.spec.triton.keep)
        if removed:
            ctx.notices.append(
                f"removed Triton repository version(s) {removed} (keep {ctx.spec.triton.keep})"
            )
