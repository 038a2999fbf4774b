"""Architecture registry: one module per family, registered under its HF `architectures` names."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class TensorRule:
    """One output tensor: its TensorRT-LLM name, the HF tensors it is made of, and how.

    kind: "norm" (copied), "embedding", "lm_head", "qkv" (q, k, v concatenated on the output
    dim), "linear" (a dense layer stored [out, in]; weight-only quantizable).
    """

    name: str
    sources: tuple[str, ...]
    kind: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Family:
    """How one HF architecture family maps onto a TensorRT-LLM checkpoint."""

    name: str
    trtllm_architecture: str
    config: Callable[[dict[str, Any]], dict[str, Any]]  # HF config -> TRT-LLM config fields
    tensors: Callable[[dict[str, Any]], Iterator[TensorRule]]
    ignored: tuple[str, ...] = ()  # HF tensor name suffixes that are expected and unused


REGISTRY: dict[str, Family] = {}


def register(*architectures: str) -> Callable[[Family], Family]:
    def add(family: Family) -> Family:
        for arch in architectures:
            REGISTRY[arch] = family
        return family

    return add


def family_for(hf_config: dict[str, Any]) -> Family:
    """The family of an HF config, or an error listing what is supported."""
    _load_all()
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in REGISTRY:
            return REGISTRY[arch]
    raise UnsupportedModelError(
        f"architecture {', '.join(archs) or '(none in config.json)'} is not supported: "
        f"supported are {', '.join(sorted(REGISTRY))}"
    )


def _load_all() -> None:
    from . import llama  # noqa: F401  (registers itself)
