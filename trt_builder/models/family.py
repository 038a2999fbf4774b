"""What a family is: the facts trt-builder needs about one HF architecture family, and the table
(`REGISTRY`) its module registers it in, under the HF `architectures` names it covers."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any


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

    def read(self, index: Any) -> list[Any]:
        """The source tensors as `index` (a SafetensorsIndex) reads them, Conv1D weights
        transposed to [out, in]; concatenated on dim 0 they are this tensor."""
        return [index.read(s).t() if self.transpose else index.read(s) for s in self.sources]

    def rows(self) -> list[int]:
        """Each source's rows in this tensor."""
        return [shape[0] for shape in self.expected()]


def _no_advice(cfg: dict[str, Any]) -> list[str]:
    return []


@dataclass(frozen=True)
class Family:
    """How one HF architecture family maps onto a TensorRT-LLM checkpoint, and what the rest of
    trt-builder needs to know about it. Every fact is here: nothing else names an architecture.

    - `config`, `tensors`: the conversion (HF config -> TensorRT-LLM config fields; the
      TensorRules of an HF config and its tensor names); `ignored`: HF tensors that are
      expected and unused (name prefixes or suffixes).
    - `gated_mlp`: SwiGLU (fc, gate and proj) rather than fc -> activation -> proj (the memory
      plan counts the linears from it).
    - `qk_norm`: RMSNorm on q and k after the projections (Qwen3).
    - `smoothquant`: TensorRT-LLM's SmoothQuant plugin formats build for the family.
    - `int8_kv_cache`: the INT8 KV cache's calibrated balancing applies (its ranges are taken
      at the projections' outputs, so not with q/k norms after them).
    - `min_release`: the oldest TensorRT-LLM release whose TensorRT backend builds it.
    - `no_llmapi`: why `--target llmapi` is not built for it (said to the user); None where
      it is (TensorRT-LLM's PyTorch backend has a model for the family).
    - `decoder_layer`: a regex that matches the transformers module path of one decoder layer
      (calibration hooks the linears under it); `vision_tower`: module-path prefixes of a vision
      tower, which is neither converted nor calibrated (the llmapi target copies it, under the
      first prefix: the hub checkpoint's name).
    - `notes`: said to the user on every conversion; `llmapi_notes`: said instead on an llmapi
      conversion (None: `notes`); `advice`: notes that depend on the config.
    """

    name: str
    config: Callable[[dict[str, Any]], dict[str, Any]]
    tensors: Callable[[dict[str, Any], set[str]], Iterator[TensorRule]]
    ignored: tuple[str, ...] = ()
    gated_mlp: bool = True
    qk_norm: bool = False
    smoothquant: bool = True
    int8_kv_cache: bool = True
    min_release: str | None = None
    no_llmapi: str | None = None
    decoder_layer: str = r"(^|\.)layers\.\d+\."
    vision_tower: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    llmapi_notes: tuple[str, ...] | None = None
    advice: Callable[[dict[str, Any]], list[str]] = _no_advice

    def __post_init__(self) -> None:
        if self.qk_norm and self.int8_kv_cache:
            raise ValueError(
                f"family {self.name}: q/k norms after the projections rule out the INT8 KV "
                "cache's calibrated balancing (its ranges are taken before the norms): set "
                "int8_kv_cache=False"
            )

    def is_ignored(self, name: str) -> bool:
        return any(name.startswith(p) or name.endswith(p) for p in self.ignored)

    def same_linear(self, path: str, names: Iterable[str]) -> str | None:
        """The one name in `names` (outside the vision tower) for the decoder linear at `path`,
        matched by the path from its decoder layer on (`layers.0.self_attn.q_proj`): a file and
        the model transformers loads from it may name a linear apart (a hub-layout Qwen2.5-VL's
        `model.layers.*` runs as `model.language_model.layers.*`; the hub's GPT-2 files name
        `transformer.h.*` as `h.*`). None where no name, or more than one, matches."""
        match = re.search(self.decoder_layer, path)
        if match is None:
            return None
        tail = path[match.start() + len(match.group(1)) :]
        found = [n for n in names if (n == tail or n.endswith("." + tail))
                 and not n.startswith(self.vision_tower)]  # fmt: skip
        return found[0] if len(found) == 1 else None


#: HF architecture name -> its family; each family module fills it in when imported.
REGISTRY: dict[str, Family] = {}


def register(*architectures: str) -> Callable[[Family], Family]:
    def add(family: Family) -> Family:
        for arch in architectures:
            REGISTRY[arch] = family
        return family

    return add
