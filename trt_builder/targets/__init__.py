"""The targets, one room each (`targets/<target>/`: spec.py and what the stages do for it),
and the registry the rest of trt-builder asks. Adding a target is a new room and one line in
ROOMS."""

from __future__ import annotations

from ..core.errors import SpecError
from .base import Target
from .engine.spec import EngineTarget
from .llmapi.spec import LlmApiTarget

#: The rooms, the default first, in the order --target lists them.
ROOMS: tuple[Target, ...] = (EngineTarget(), LlmApiTarget())
TARGETS = tuple(target.name for target in ROOMS)
#: What each target makes, as plan and doctor say it.
TARGET_MAKES = {target.name: target.MAKES for target in ROOMS}

__all__ = ["ROOMS", "TARGETS", "TARGET_MAKES", "Target", "target_for"]


def target_for(name: str) -> Target:
    """The target --target `name` names."""
    for target in ROOMS:
        if target.name == name:
            return target
    raise SpecError(
        f"target {name!r} is not one of {', '.join(TARGETS)}: use --target engine "
        "(trtllm-build) or llmapi (TensorRT-LLM's PyTorch backend)"
    )
