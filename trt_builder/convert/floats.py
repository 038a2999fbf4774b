"""HF checkpoint -> TensorRT-LLM checkpoint (config.json + rank{N}.safetensors), streamed.

Every name and shape is checked against the config before anything is written; then one HF
tensor set at a time is read, combined (rewritten for the INT8 KV cache, then clipped for INT8
weight-only, both from the calibration), checked for NaN/Inf, cast, split into its ranks and
written at its place in each rank file. Peak memory is about the largest tensor, whatever the
model's size.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

import torch

from ..checkpoint.mapping import Mapping
from ..checkpoint.parallel import shard
from ..checkpoint.safetensors_io import SafetensorsIndex, StreamingWriter
from ..core.dtypes import torch_dtype
from ..models.family import TensorRule
from ..modes import QuantMode
from ..modes.kvcache.convert import KVCacheScales
from .plan import plan_conversion
from .write import checker, finish, load_sources

#: How a rule's source tensors are rewritten before they are split and cast (the INT8 KV
#: cache's balancing, trt_builder/modes/kvcache/convert.py; INT8 weight-only clipping,
#: modes/weight_only/convert.py), by TensorRT-LLM name.
Transform = Callable[[list[torch.Tensor]], list[torch.Tensor]]
Rewrite = dict[str, Transform]


class WeightRewrite(Protocol):
    """A mode's own rewrite of the weights, after the KV cache's (INT8 weight-only clipping,
    modes/weight_only/convert.py)."""

    def rewrite(
        self,
        rules: list[TensorRule],
        rewrite: Rewrite,
        inputs: dict[str, torch.Tensor],
        dtype: torch.dtype,
        tp: int,
    ) -> Rewrite:
        """`rewrite` with this one after it. `inputs`: factors the linears' input channels
        come multiplied by (the KV cache's balancing)."""
        ...

    def producer(self) -> dict[str, Any] | None:
        """After the write: what config.json's `producer` records of it (None: nothing)."""
        ...

    def summary(self) -> dict[str, Any]:
        """After the write: what it adds to convert's summary."""
        ...


def then(first: Transform | None, second: Transform) -> Transform:
    """`second` after `first` (if any)."""
    return second if first is None else lambda parts: second(first(parts))


def _stream(
    rules: list[TensorRule],
    index: SafetensorsIndex,
    writers: list[StreamingWriter],
    mapping: Mapping,
    dtype: torch.dtype,
    rewrite: Rewrite | None = None,
) -> None:
    """Write every tensor; the kernel reads the next one ahead while this one is cast.

    One torch thread casts: the output's disk is the limit, and on a small host a second
    intra-op thread mostly spins (docs/benchmarks.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i, rule in enumerate(rules):
            if i + 1 < len(rules):
                index.prefetch(rules[i + 1].sources)
            _write_one(rule, index, writers, mapping, dtype, (rewrite or {}).get(rule.name))
    finally:
        torch.set_num_threads(threads)


def _write_one(
    rule: TensorRule,
    index: SafetensorsIndex,
    writers: list[StreamingWriter],
    mapping: Mapping,
    dtype: torch.dtype,
    rewrite: Transform | None = None,
) -> None:
    """Map, split, cast, check and write one tensor, a block at a time. Its own function so
    that every view of the input mapping is gone when it returns."""
    # W8A16 linears too are written in the model dtype, [out, in]: trtllm-build quantizes
    # them at load into the GPU-specific layout its weight-only GEMM needs (docs/design.md).
    check = checker(rule, dtype)
    parts = load_sources(rule, index)
    if rewrite is not None:
        parts = rewrite(parts)
    for rank, name, pieces in shard(rule.name, parts, mapping):
        writers[rank].write(name, pieces, check)


def convert_checkpoint(
    hf_dir: Path,
    out_dir: Path,
    mode: QuantMode,
    *,
    tp: int = 1,
    pp: int = 1,
    calibration: Path | None = None,
    remember: Callable[[Path, str], None] | None = None,
    weights: WeightRewrite | None = None,
) -> dict[str, Any]:
    """Convert `hf_dir` into a TensorRT-LLM checkpoint in `out_dir`; return a summary
    (`remember`: given each rank file's sha256, hashed as it was written). The
    INT8 and FP8 KV caches take their scales from the statistics in `calibration`; `weights`:
    the mode's own rewrite of the weights (INT8 weight-only clipping), if any."""
    family, config, rules, index, notes = plan_conversion(hf_dir, mode, tp=tp, pp=pp)
    mapping = Mapping.from_config(config)
    dtype = torch_dtype(config["dtype"])
    rewrite: Rewrite = {}
    extras: dict[str, torch.Tensor] = {}
    inputs: dict[str, torch.Tensor] = {}
    with index:  # closed here if the statistics are refused
        kv = KVCacheScales.of(mode, config, family, {r.name for r in rules}, calibration)
        rewrite, extras, inputs = _kv_cache(kv, rules, v_channels=mode.weights is None)
        if weights is not None:
            rewrite = weights.rewrite(rules, rewrite, inputs, dtype, mapping.tp)
    plans: list[dict[str, tuple[torch.dtype, tuple[int, ...]]]] = [{} for _ in range(mapping.world)]
    for rule in rules:  # shapes per rank, from the same split code run on meta tensors
        for rank, name, pieces in shard(
            rule.name, [torch.empty(rule.shape, device="meta")], mapping
        ):
            plans[rank][name] = (dtype, (sum(p.shape[0] for p in pieces), *pieces[0].shape[1:]))
    for extra, tensor in extras.items():  # replicated across tensor-parallel ranks
        for rank, name, _ in shard(extra, [tensor], mapping):
            plans[rank][name] = (tensor.dtype, tuple(tensor.shape))
    with ExitStack() as stack:
        stack.enter_context(index)
        writers = [
            stack.enter_context(
                StreamingWriter(
                    out_dir / f"rank{rank}.safetensors", plan, {"format": "pt"}, remember
                )
            )
            for rank, plan in enumerate(plans)
        ]
        _stream(rules, index, writers, mapping, dtype, rewrite)
        for extra, tensor in extras.items():
            for rank, name, pieces in shard(extra, [tensor], mapping):
                writers[rank].write(name, pieces)
    if extras:
        config["quantization"]["kv_cache_quant_algo"] = mode.kv_cache_quant_algo
    producer = weights.producer() if weights is not None else None
    if producer:  # modelopt's checkpoints carry a producer too; TensorRT-LLM keeps it as is
        config["producer"] = {"name": "trt-builder", **producer}
    summary = finish(out_dir, config, family, tensors=len(rules) + len(extras), notes=notes)
    return {**summary, **(weights.summary() if weights is not None else {})}


def _kv_cache(
    kv: KVCacheScales, rules: list[TensorRule], *, v_channels: bool
) -> tuple[Rewrite, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The quantized KV cache on a float or weight-only checkpoint: the INT8 cache's balancing
    rewrite of every layer's qkv rows and dense input columns, each layer's
    kv_cache_scaling_factor, and the factor dense's input channels now come multiplied by, by
    weight name (the FP8 cache's scales alone: its weights are written as they are).
    `v_channels`: False where the mode quantizes its linears (kvcache.balance)."""
    rewrite: Rewrite = {}
    extras: dict[str, torch.Tensor] = {}
    inputs: dict[str, torch.Tensor] = {}
    for rule in rules:
        if not rule.name.endswith(".attention.qkv.weight"):
            continue
        prefix = rule.name.removesuffix("qkv.weight")
        balanced = kv.balance(rule.sources, v_channels=v_channels)
        if balanced is not None:
            rewrite[rule.name] = rewrite[prefix + "qkv.bias"] = _scale_rows(balanced.qkv_rows)
            rewrite[prefix + "dense.weight"] = _scale_columns(1.0 / balanced.dense_in)
            inputs[prefix + "dense.weight"] = balanced.dense_in
        scale = kv.scale(rule.sources, balanced)
        if scale is not None:
            extras[prefix + "kv_cache_scaling_factor"] = scale
    return rewrite, extras, inputs


def _scale_rows(factors: torch.Tensor) -> Transform:
    """Multiply the rows of the concatenated parts (e.g. q, k, v) by `factors`."""

    def apply(parts: list[torch.Tensor]) -> list[torch.Tensor]:
        out, row = [], 0
        for part in parts:
            n = part.shape[0]
            f = factors[row : row + n].reshape(n, *([1] * (part.dim() - 1)))
            out.append(part.float() * f)
            row += n
        return out

    return apply


def _scale_columns(factors: torch.Tensor) -> Transform:
    return lambda parts: [part.float() * factors[None, :] for part in parts]
