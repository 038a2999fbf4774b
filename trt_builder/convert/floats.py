"""HF checkpoint -> TensorRT-LLM checkpoint (config.json + rank{N}.safetensors), streamed.

Every name and shape is checked against the config before anything is written; then one HF
tensor set at a time is read, combined, checked for NaN/Inf, cast, split into its ranks and
written at its place in each rank file. Peak memory is about the largest tensor, whatever the
model's size.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from ..calibrate.stats import load_stats
from ..checkpoint.mapping import Mapping
from ..checkpoint.parallel import shard
from ..checkpoint.safetensors_io import SafetensorsIndex, StreamingWriter
from ..core.dtypes import torch_dtype
from ..core.errors import ConversionError
from ..models.family import Family, TensorRule
from ..spec.modes import QuantMode
from .kvcache import balance, qkv_ranges, refuse_unsupported
from .plan import plan_conversion
from .write import checker, finish, load_sources

#: How a rule's source tensors are rewritten before they are split and cast (the INT8 KV
#: cache's balancing, trt_builder/convert/kvcache.py), by TensorRT-LLM name.
Rewrite = dict[str, Callable[[list[torch.Tensor]], list[torch.Tensor]]]


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
    rewrite: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
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
) -> dict[str, Any]:
    """Convert `hf_dir` into a TensorRT-LLM checkpoint in `out_dir`; return a summary. The
    INT8 KV cache (`mode.kv_int8`) takes its scales from the statistics in `calibration`."""
    family, config, rules, index, notes = plan_conversion(hf_dir, mode, tp=tp, pp=pp)
    mapping = Mapping.from_config(config)
    dtype = torch_dtype(config["dtype"])
    rewrite: Rewrite = {}
    extras: dict[str, torch.Tensor] = {}
    if getattr(mode, "kv_int8", False):
        with index:  # closed here if the statistics are refused
            rewrite, extras = _kv_cache(config, family, rules, calibration)
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
                StreamingWriter(out_dir / f"rank{rank}.safetensors", plan, {"format": "pt"})
            )
            for rank, plan in enumerate(plans)
        ]
        _stream(rules, index, writers, mapping, dtype, rewrite)
        for extra, tensor in extras.items():
            for rank, name, pieces in shard(extra, [tensor], mapping):
                writers[rank].write(name, pieces)
    if extras:
        config["quantization"]["kv_cache_quant_algo"] = "INT8"
    return finish(out_dir, config, family, tensors=len(rules) + len(extras), notes=notes)


def _kv_cache(
    config: dict[str, Any], family: Family, rules: list[TensorRule], calibration: Path | None
) -> tuple[Rewrite, dict[str, torch.Tensor]]:
    """The INT8 KV cache on a float or weight-only checkpoint: the balancing rewrite of every
    layer's qkv rows and dense input columns, and each layer's kv_cache_scaling_factor."""

    refuse_unsupported(config, family, {r.name for r in rules})
    v_channels = config["quantization"]["quant_algo"] != "W8A16"  # see kvcache.balance
    if calibration is None:
        raise ConversionError("the INT8 KV cache needs a calibration: run trt-builder calibrate")
    stats = load_stats(calibration)
    rewrite: Rewrite = {}
    extras: dict[str, torch.Tensor] = {}
    for rule in rules:
        if not rule.name.endswith(".attention.qkv.weight"):
            continue
        prefix = rule.name.removesuffix("qkv.weight")
        kv = balance(qkv_ranges(stats, rule.sources), config, v_channels=v_channels)
        rewrite[rule.name] = rewrite[prefix + "qkv.bias"] = _scale_rows(kv.qkv_rows)
        rewrite[prefix + "dense.weight"] = _scale_columns(1.0 / kv.dense_in)
        extras[prefix + "kv_cache_scaling_factor"] = kv.scale
    return rewrite, extras


def _scale_rows(factors: torch.Tensor) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
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


def _scale_columns(factors: torch.Tensor) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    return lambda parts: [part.float() * factors[None, :] for part in parts]
