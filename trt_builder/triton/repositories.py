"""Any repository trt-builder wrote, whichever target's: which kind it is (each target's room
says of its own, triton/kinds.py) and its validation. What serve, reload, bench and
`package --check` read a repository through."""

from __future__ import annotations

from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from ..core.errors import PackageError
from ..core.rooms import load_rooms
from ..targets import ROOMS
from .kinds import KINDS, RepositoryKind
from .repository import load_config


def read_repository(root: Path) -> tuple[RepositoryKind, dict[str, mc.ModelConfig]]:
    """The kind of the repository at `root` and its models' configs, validated: Triton's schema
    for every config.pbtxt, then the kind's own checks. Raises PackageError naming the model."""
    if not root.is_dir():
        raise PackageError(f"{root} is not a directory: give the Triton model repository")
    configs = {p.parent.name: load_config(p) for p in sorted(root.glob("*/config.pbtxt"))}
    if not configs:
        raise PackageError(f"{root} holds no model (no */config.pbtxt)")
    load_rooms("targets", "triton")
    kinds = [KINDS[type(target)] for target in ROOMS]
    kind = next((k for k in kinds[1:] if k.claims(configs)), kinds[0])
    return kind, kind.validate(root, configs)


def validate_repository(root: Path) -> dict[str, mc.ModelConfig]:
    """read_repository's configs."""
    return read_repository(root)[1]
