"""Where each target's room registers its Triton repository (its triton.py): what the package
stage writes for it (a Packager), and how the code that reads any repository (serve, reload,
bench, package --check: triton/repositories.py) tells it apart and reads it (a RepositoryKind).
Nothing here loads the rooms: the modules that ask do."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import singledispatch
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..targets import Target

if TYPE_CHECKING:
    from tritonclient.grpc import model_config_pb2 as mc

    from ..core.stage import BuildContext

    Configs = dict[str, mc.ModelConfig]


class Packager(ABC):
    """What the package stage does for one target: the stage's inputs, its key's parameters
    and the repository it writes into `work` (published by the stage)."""

    @abstractmethod
    def inputs(self, ctx: BuildContext) -> dict[str, Path]: ...

    @abstractmethod
    def params(self, ctx: BuildContext) -> dict[str, Any]: ...

    @abstractmethod
    def run(self, ctx: BuildContext, work: Path) -> dict[str, Any]: ...


@singledispatch
def packager(target: Target) -> Packager:
    """The package stage's work for `target` (each target's room registers its own)."""
    raise TypeError(f"internal: no Triton repository for {type(target).__name__}")


@dataclass(frozen=True)
class RepositoryKind:
    """One target's Triton repository, as the code that reads any repository asks it."""

    target: type[Target]
    #: Whether a repository whose configs these are is this kind (the default target's kind
    #: is assumed where no other claims one: its validation names what is wrong).
    claims: Callable[[Configs], bool]
    #: Check the repository at `root` (PackageError naming what is wrong); the models' configs.
    validate: Callable[[Path, Configs], Configs]
    #: The models a server loads from it, composing models last.
    models: Callable[[Configs], tuple[str, ...]]
    #: Where its tokenizer is (None: it has none).
    tokenizer: Callable[[Path], Path | None]
    #: Refuse, before a server starts, a repository this host cannot serve.
    check_host: Callable[[Path], None]


#: The kinds, by their target's type (registered by the rooms' triton.py).
KINDS: dict[type[Target], RepositoryKind] = {}


def register_kind(kind: RepositoryKind) -> None:
    KINDS[kind.target] = kind
