"""What the layer-wise quantizing converters (SmoothQuant, FP8) share: read a decoder layer's
float tensors (the next one on a thread while this one is written), turn them into the layer's
checkpoint tensors by the mode's own function, and write every rank file in the float layout's
order (embedding, layers, ln_f and lm_head), split as checkpoint/parallel.py splits it."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.mapping import Mapping
from ..checkpoint.parallel import shard
from ..checkpoint.safetensors_io import StreamingWriter
from ..core.errors import ConversionError
from ..models.family import TensorRule
from .write import checker, load_sources

#: One layer's checkpoint tensors (names without the layer prefix) from layer i's float
#: tensors and their HF sources, both by name without the prefix.
LayerTensors = Callable[[int, dict[str, torch.Tensor], dict[str, tuple[str, ...]]],
                        dict[str, torch.Tensor]]  # fmt: skip


def split_layers(rules: list[TensorRule]) -> tuple[dict[int, list[TensorRule]], list[TensorRule]]:
    """The decoder layers' rules by layer, and the others (embedding first, then ln_f, lm_head)."""
    layers: dict[int, list[TensorRule]] = {}
    others: list[TensorRule] = []
    for rule in rules:
        if rule.name.startswith("transformer.layers."):
            layers.setdefault(int(rule.name.split(".")[2]), []).append(rule)
        else:
            others.append(rule)
    return layers, others


def _meta(rule: TensorRule) -> torch.Tensor:
    return torch.empty(rule.shape, device="meta")


@dataclass
class LayerJob:
    """One conversion that quantizes layer by layer: the layers' rules, the other tensors, and
    the mode's function from a layer's float tensors to its checkpoint tensors."""

    layer_tensors: LayerTensors
    layers: dict[int, list[TensorRule]]
    others: list[TensorRule]
    index: Any
    dtype: torch.dtype
    mapping: Mapping
    device: str
    #: What a rank's part of a tensor becomes in its file (name on the rank, the part): INT4
    #: weights are packed per rank, after the split (None: as it is).
    per_rank: Callable[[str, torch.Tensor], torch.Tensor] | None = None

    def _final(self, local: str, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.per_rank is None:
            return pieces
        return [self.per_rank(local, pieces[0] if len(pieces) == 1 else torch.cat(pieces))]

    def layer(self, i: int, read: Any) -> dict[str, torch.Tensor]:
        """Layer i's checkpoint tensors, from its float tensors as `read` gives them."""
        group = self.layers[i]
        floats = {r.name.split(".", 3)[3]: read(r) for r in group}
        sources = {r.name.split(".", 3)[3]: r.sources for r in group}
        tensors = self.layer_tensors(i, floats, sources)
        return {f"transformer.layers.{i}.{k}": v for k, v in tensors.items()}

    def real(self, rule: TensorRule) -> torch.Tensor:
        """A rule's source tensors, concatenated, in float32; refuses NaN and Inf."""
        parts = load_sources(rule, self.index)
        tensor = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(self.device).float()
        if not bool(torch.isfinite(tensor).all()):
            raise ConversionError(
                f"{rule.name} ({', '.join(rule.sources)}) contains NaN or Inf values"
            )
        return tensor

    def rank_plans(self) -> list[dict[str, tuple[torch.dtype, tuple[int, ...]]]]:
        """Each rank file's tensors (dtype, shape) in writing order, from meta tensors: split
        into ranks as the float layout's (checkpoint/parallel.py)."""
        plans: list[dict[str, tuple[torch.dtype, tuple[int, ...]]]] = [
            {} for _ in range(self.mapping.world)
        ]

        def add(name: str, t: torch.Tensor) -> None:
            for rank, local, pieces in shard(name, [t], self.mapping):
                final = self._final(local, pieces)
                shape = (
                    (sum(p.shape[0] for p in final), *final[0].shape[1:])
                    if final[0].dim()
                    else ()  # a scalar (NVFP4's global scales)
                )
                plans[rank][local] = (final[0].dtype, shape)

        for rule in self.others[:1]:  # the embedding first, as in the float layout
            add(rule.name, torch.empty(rule.shape, dtype=self.dtype, device="meta"))
        for i in sorted(self.layers):
            for name, t in self.layer(i, _meta).items():
                add(name, t)
        for rule in self.others[1:]:
            add(rule.name, torch.empty(rule.shape, dtype=self.dtype, device="meta"))
        return plans

    def write(
        self, stack: ExitStack, out_dir: Path, remember: Callable[[Path, str], None] | None
    ) -> int:
        """Smooth, quantize and write every rank file; the count of tensors written."""
        plans = self.rank_plans()
        writers = [
            stack.enter_context(
                StreamingWriter(
                    out_dir / f"rank{rank}.safetensors", plan, {"format": "pt"}, remember
                )
            )
            for rank, plan in enumerate(plans)
        ]

        def put(name: str, parts: list[torch.Tensor], check: Any = None) -> None:
            for rank, local, pieces in shard(name, parts, self.mapping):
                writers[rank].write(local, self._final(local, pieces), check)

        for rule in self.others[:1]:
            put(rule.name, load_sources(rule, self.index), checker(rule, self.dtype))
        order = sorted(self.layers)
        # the next layer's float tensors are read (and moved to the GPU) on a thread while
        # this one is smoothed, quantized and written: reading and writing overlap
        with ThreadPoolExecutor(1, thread_name_prefix="convert-read") as pool:
            ahead = pool.submit(self.read_layer, order[0]) if order else None
            for n, i in enumerate(order):
                assert ahead is not None
                floats = ahead.result()
                if n + 1 < len(order):
                    ahead = pool.submit(self.read_layer, order[n + 1])
                self.write_layer(i, floats, put)
        for rule in self.others[1:]:
            put(rule.name, load_sources(rule, self.index), checker(rule, self.dtype))
        return sum(len(p) for p in plans)

    def read_layer(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's float tensors (`real`), by rule name."""
        return {rule.name: self.real(rule) for rule in self.layers[i]}

    def write_layer(self, i: int, floats: dict[str, torch.Tensor], put: Any) -> None:
        """Smooth, quantize and write layer i from its float tensors."""
        for name, tensor in self.layer(i, lambda rule: floats[rule.name]).items():
            # (e4m3 tensors were checked before their cast, which clamps: torch has no isfinite)
            floating = tensor.is_floating_point() and tensor.element_size() > 1
            if floating and not bool(torch.isfinite(tensor).all()):
                raise ConversionError(
                    f"{name} is not finite after smoothing: recalibrate (trt-builder calibrate --force)"
                )
            put(name, [tensor.cpu()])
