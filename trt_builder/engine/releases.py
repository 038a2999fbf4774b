"""The pinned TensorRT-LLM releases that still ship trtllm-build, and what each accepts."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import EngineError
from ..models.registry import load_all


@dataclass(frozen=True)
class Release:
    """A pinned TensorRT-LLM release line (docs/engine.md has the sources)."""

    version: str  # major.minor
    tensorrt: str | None  # the TensorRT it is built with (an engine needs the same at run time)
    container: str | None  # the NGC tritonserver:<tag>-trtllm-python-py3 that ships it
    rejects: frozenset[str] = frozenset()  # trtllm-build flags it no longer accepts


#: Releases that still ship trtllm-build. In all of them the flags we pass exist with the same
#: meaning and `--tokens_per_block` defaults to 32; SmoothQuant `*_PLUGIN` checkpoints switch
#: the SmoothQuant plugins on by themselves (builder.py), so no release takes a flag for them.
RELEASES = (
    Release("0.20", "10.10", "25.06"),
    Release("0.21", "10.11", "25.08"),
    Release("1.0", "10.11", "25.09"),
    Release("1.1", "10.13", "25.12"),
    Release("1.2", None, None, frozenset({"--auto_parallel", "--gpus_per_node", "--cluster_key"})),
)


PINNED = f">={RELEASES[0].version},<1.3"


#: The release the Dockerfile's image is built on: the newest whose NGC container is known.
IMAGE_RELEASE = next(r for r in reversed(RELEASES) if r.container)


def container_image(release: Release = IMAGE_RELEASE) -> str:
    """The NGC Triton + TensorRT-LLM image that ships `release` (the Dockerfile's base)."""
    return f"nvcr.io/nvidia/tritonserver:{release.container}-trtllm-python-py3"


def release_for(trtllm_version: str) -> Release:
    """The release line of an installed TensorRT-LLM; refuses one outside the pinned range."""
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(trtllm_version)
    except InvalidVersion:
        raise EngineError(
            f"TensorRT-LLM version {trtllm_version!r} is not readable: install tensorrt-llm{PINNED}"
        ) from None
    for release in RELEASES:
        if (v.major, v.minor) == tuple(int(x) for x in release.version.split(".")):
            return release
    raise EngineError(
        f"TensorRT-LLM {trtllm_version} is not a pinned release (it must still ship trtllm-build "
        f"with the TensorRT backend): install tensorrt-llm{PINNED} or use its NGC container"
    )


def check_release(architecture: str, trtllm_version: str) -> None:
    """Refuse a build the installed TensorRT-LLM cannot do (when its version is known)."""
    from packaging.version import InvalidVersion, Version

    if trtllm_version == "absent":
        return
    release_for(trtllm_version)
    family = load_all().get(architecture)  # another producer's architecture: no known minimum
    need = family.min_release if family is not None else None
    if need is None:
        return
    try:
        too_old = Version(trtllm_version) < Version(need)
    except InvalidVersion:
        return
    if too_old:
        raise EngineError(
            f"{architecture} engines need TensorRT-LLM >= {need}, this host has {trtllm_version}: "
            f"install tensorrt-llm>={need},<1.3 (or use the matching NGC container)"
        )
