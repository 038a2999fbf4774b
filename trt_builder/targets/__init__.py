"""The targets, one room each (`targets/<target>/`: spec.py and what the stages do for it),
and the registry the rest of trt-builder asks. Adding a target is a new room and one line in
ROOMS."""

from __future__ import annotations

from ..core.errors import SpecError
from ..modes import Mode
from .base import Target
from .engine.spec import EngineTarget
from .llmapi.spec import LlmApiTarget

#: The rooms, the default first, in the order --target lists them.
ROOMS: tuple[Target, ...] = (EngineTarget(), LlmApiTarget())
TARGETS = tuple(target.name for target in ROOMS)
#: What each target makes, as plan and doctor say it.
TARGET_MAKES = {target.name: target.MAKES for target in ROOMS}
#: What the verify stage can run a checkpoint in (verify.runtime), the default first.
VERIFY_RUNTIMES = tuple(dict.fromkeys(r for target in ROOMS for r in target.VERIFY_RUNTIMES))

__all__ = ["ROOMS", "TARGETS", "TARGET_MAKES", "VERIFY_RUNTIMES", "Target", "target_for",
           "verify_refusal"]  # fmt: skip


def target_for(name: str) -> Target:
    """The target --target `name` names."""
    for target in ROOMS:
        if target.name == name:
            return target
    raise SpecError(
        f"target {name!r} is not one of {', '.join(TARGETS)}: use --target engine "
        "(trtllm-build) or llmapi (TensorRT-LLM's PyTorch backend)"
    )


def verify_refusal(target: Target, runtime: str, mode: Mode) -> str | None:
    """Why the verify stage cannot run `target`'s checkpoint of `mode` in `runtime`
    (verify.runtime), naming what would; None where it can."""
    if runtime in target.VERIFY_RUNTIMES:
        return target.verify_refusal(runtime, mode)
    takes = [t.name for t in ROOMS if runtime in t.VERIFY_RUNTIMES]
    return (
        f"verify.runtime {runtime} does not run what --target {target.name} writes: use "
        f"--target {' or '.join(takes)}, or verify.runtime {' or '.join(target.VERIFY_RUNTIMES)}"
    )
