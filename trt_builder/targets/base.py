"""What every target answers: what a build makes and for which runtime. A target is one room
(`targets/<target>/`, core/rooms.py): spec.py is this class's subclass, and its modules at
later layers register what the stages do for it (convert.py: the checkpoint it writes;
triton.py: its Triton repository), keyed by its type. The stages ask the target (these
methods, or a registry keyed by its type); they never test its name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from ..modes import KV_CACHE_CHOICES, Mode

if TYPE_CHECKING:
    from ..spec.build import BuildSpec


class Target(ABC):
    #: --target's value.
    name: ClassVar[str]
    #: What it makes, as plan and doctor say it.
    MAKES: ClassVar[str]
    #: Whether it builds an engine (the engine stage runs only then).
    builds_engine: ClassVar[bool]
    #: The --kv-cache choices it builds.
    KV_CACHES: ClassVar[tuple[str, ...]] = KV_CACHE_CHOICES
    #: What can run its checkpoint in the verify stage (verify.runtime): trt-builder's
    #: checkpoint runtime ("reference") always; a real serving runtime where one loads it.
    VERIFY_RUNTIMES: ClassVar[tuple[str, ...]] = ("reference",)

    @property
    def variant_suffix(self) -> str:
        """What its variants' directory names add after the mode's (the default target: "")."""
        return f"-{self.name}"

    def refusal(self, mode: Mode, dtype: str) -> str | None:
        """Why it does not build `mode` (`dtype`: the --dtype given), or None: the mode says
        for itself (Mode.REFUSED_BY), then the KV cache beside it."""
        return mode.target_refusal(self.name) or self.kv_refusal(mode, dtype)

    def verify_refusal(self, runtime: str, mode: Mode) -> str | None:
        """Why the verify stage cannot run this target's checkpoint of `mode` in `runtime`, one
        of VERIFY_RUNTIMES (targets/__init__.py: verify_refusal asks), or None."""
        return None

    def gpu_needs(self, mode: Mode) -> tuple[str, ...]:
        """The GPU features `mode` needs of the target GPU where this target deploys it."""
        return mode.gpu_needs

    def kv_refusal(self, mode: Mode, dtype: str) -> str | None:
        """Why it does not build the KV cache of `mode`, or None."""
        return None

    def refuse_family(self, family: Any, architecture: str) -> None:
        """Refuse a model family (models/family.py Family) it does not build, with the way out
        (this one builds every family)."""
        return None

    def engine_refusal(self) -> str | None:
        """Why the engine stage, asked for by name, is refused (None: it builds an engine)."""
        return None

    def here(self, report: dict[str, Any], *, tritonserver: bool) -> str:
        """What it does on this host, as doctor says it (`report`: engine/doctor.py's;
        `tritonserver`: whether one is found)."""
        return "the modes above"

    @abstractmethod
    def convert_params(self, spec: BuildSpec) -> dict[str, Any]:
        """What convert's key takes of the spec for this target."""
