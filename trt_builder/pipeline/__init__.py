"""The stages in order (build.py: run), the memory plan before a build (plan.py), and verify
on its own (standalone.py): everything the CLI does, callable from Python."""

from .build import STAGE_NAMES, STAGES, BuildResult, run

__all__ = ["STAGES", "STAGE_NAMES", "BuildResult", "run"]
