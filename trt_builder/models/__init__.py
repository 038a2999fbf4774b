"""Architecture registry: one module per family, registered under its HF `architectures` names."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class TensorRule:
    """One output tensor (full model, TP=1): its TensorRT-LLM name, the HF tensors it is made of
    (several are concatenated on dim 0, as q, k and v into qkv), and its shape. `transpose`
    marks HF Conv1D weights, stored [in, out]."""

    name: str
    sources: tuple[str, ...]
    shape: tuple[int, ...]
    transpose: bool = False
    source_shapes: tuple[tuple[int, ...], ...] = ()  # each source's shape, for several sources

    def expected(self) -> tuple[tuple[int, ...], ...]:
        """The shape each source must have (after the Conv1D transpose)."""
        if len(self.sources) > 1 and len(self.source_shapes) != len(self.sources):
            raise ValueError(f"{self.name}: a rule with several sources needs one shape per source")
        return self.source_shapes or (self.shape,)


@dataclass(frozen=True)
class Family:
    """How one HF architecture family maps onto a TensorRT-LLM checkpoint."""

    name: str
    config: Callable[[dict[str, Any]], dict[str, Any]]  # HF config -> TRT-LLM config fields
    tensors: Callable[[dict[str, Any], set[str]], Iterator[TensorRule]]  # (HF config, HF names)
    ignored: tuple[str, ...] = ()  # HF tensor name prefixes/suffixes that are expected and unused
    notes: tuple[str, ...] = field(default=())  # said to the user on every conversion
    advice: Callable[[dict[str, Any]], list[str]] = (
        lambda cfg: []
    )  # notes that depend on the config

    def is_ignored(self, name: str) -> bool:
        return any(name.startswith(p) or name.endswith(p) for p in self.ignored)


REGISTRY: dict[str, Family] = {}


def register(*architectures: str) -> Callable[[Family], Family]:
    def add(family: Family) -> Family:
        for arch in architectures:
            REGISTRY[arch] = family
        return family

    return add


def family_for(hf_config: dict[str, Any]) -> Family:
    """The family of an HF config, or an error listing what is supported."""
    load_all()
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in REGISTRY:
            return REGISTRY[arch]
    raise UnsupportedModelError(
        f"architecture {', '.join(archs) or '(none in config.json)'} is not supported: "
        f"supported are {', '.join(sorted(REGISTRY))}"
    )


def load_all() -> None:
    from . import gpt2, llama, qwen  # noqa: F401  (each registers itself)
