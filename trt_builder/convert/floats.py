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
from typing import Any

import torch

from ..calibrate.stats import load_stats
from ..checkpoint.mapping import Mapping
from ..checkpoint.parallel import shard, tp_kind
from ..checkpoint.safetensors_io import SafetensorsIndex, StreamingWriter
from ..core.dtypes import torch_dtype
from ..core.errors import ConversionError
from ..models.family import TensorRule
from ..spec.modes import QuantMode
from .clipping import CLIPPED_LINEARS, ClipTally, clip_weight
from .clipping import record as clipping_record
from .kvcache import KVCacheScales
from .plan import plan_conversion
from .write import checker, finish, load_sources

#: How a rule's source tensors are rewritten before they are split and cast (the INT8 KV
#: cache's balancing, trt_builder/convert/kvcache.py; INT8 weight-only clipping, clipping.py),
#: by TensorRT-LLM name.
Transform = Callable[[list[torch.Tensor]], list[torch.Tensor]]
Rewrite = dict[str, Transform]


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
) -> dict[str, Any]:
    """Convert `hf_dir` into a TensorRT-LLM checkpoint in `out_dir`; return a summary
    (`remember`: given each rank file's sha256, hashed as it was written). The
    INT8 and FP8 KV caches take their scales from the statistics in `calibration`, and
    INT8 weight-only clipping (`mode.clip`) its weighting; without them the weights are
    written unclipped (the builder's plain rounding)."""
    family, config, rules, index, notes = plan_conversion(hf_dir, mode, tp=tp, pp=pp)
    mapping = Mapping.from_config(config)
    dtype = torch_dtype(config["dtype"])
    rewrite: Rewrite = {}
    extras: dict[str, torch.Tensor] = {}
    inputs: dict[str, torch.Tensor] = {}
    tally = ClipTally()
    with index:  # closed here if the statistics are refused
        kv = KVCacheScales.of(mode, config, family, {r.name for r in rules}, calibration)
        rewrite, extras, inputs = _kv_cache(kv, rules, v_channels=mode.weights is None)
        if mode.clips and calibration is not None:
            rewrite = _clipping(
                rules, load_stats(calibration), rewrite, inputs, dtype, mapping.tp, tally
            )
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
    if tally.rows:  # modelopt's checkpoints carry a producer too; TensorRT-LLM keeps it as is
        config["producer"] = {"name": "trt-builder", "weight_clipping": clipping_record()}
    summary = finish(out_dir, config, family, tensors=len(rules) + len(extras), notes=notes)
    if tally.rows:
        summary["weight_clipping"] = tally.summary()
    return summary


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


def _clipping(
    rules: list[TensorRule],
    stats: dict[str, torch.Tensor],
    rewrite: Rewrite,
    inputs: dict[str, torch.Tensor],
    dtype: torch.dtype,
    tp: int,
    tally: ClipTally,
) -> Rewrite:
    """`rewrite` with INT8 weight-only clipping after it on every clipped linear (the builder
    quantizes the final weights). `inputs`: factors their input channels come multiplied by
    (W' = W / f, x' = x f: E[x'^2] = E[x^2] f^2)."""
    out = dict(rewrite)
    for rule in rules:
        if not (
            rule.name.startswith("transformer.layers.") and rule.name.endswith(CLIPPED_LINEARS)
        ):
            continue
        module = rule.sources[0].removesuffix(".weight")  # q/k/v and gate/up share one input
        if f"{module}.input_sqmean" not in stats:
            raise ConversionError(
                f"the calibration has no input_sqmean for {module}: recalibrate this model "
                "(trt-builder calibrate --force)"
            )
        sqmean = stats[f"{module}.input_sqmean"].float()
        if rule.name in inputs:
            sqmean = sqmean * inputs[rule.name].float().square()
        # row-parallel ranks each quantize their slice of the columns: one search per slice
        slices = tp if tp_kind(rule.name) == "row" else 1
        out[rule.name] = _then(rewrite.get(rule.name), _clip(sqmean, dtype, slices, tally))
    return out


def _clip(sqmean: torch.Tensor, dtype: torch.dtype, slices: int, tally: ClipTally) -> Transform:
    """Clip the rows of each part (q, k, v), each of its `slices` column slices on its own."""

    def one(part: torch.Tensor) -> torch.Tensor:
        pieces = zip(part.chunk(slices, 1), sqmean.chunk(slices), strict=True)
        return torch.cat([clip_weight(w, s, dtype, tally) for w, s in pieces], 1)

    return lambda parts: [one(part) for part in parts]


def _then(first: Transform | None, second: Transform) -> Transform:
    return second if first is None else lambda parts: second(first(parts))


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
