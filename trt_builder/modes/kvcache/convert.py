"""The INT8 KV cache: one scale per layer, made to fit every channel of K and V.

TensorRT-LLM's INT8 KV cache stores round(x / s) of K (after RoPE) and of V, with one scale s per
layer (`attention.kv_cache_scaling_factor`). Calibrated ranges differ widely between channels
and between K and V (SmolLM2's layer 0: |k| reaches 10.8, |v| 0.6), so a scale that covers the
largest leaves most channels, and V above all, a handful of levels.

Before s is chosen, each layer is rewritten by an equivalence that is exact in real arithmetic
(and for the INT8 GEMMs exact in their scales, docs/quantization.md):
- V channel (g, d) of KV head g is multiplied by T / a_v[g, d] (INT8 weight-only: all of V by
  T / max a_v, see `balance`). Attention averages V, so the
  output of every query head that reads head g is multiplied the same way on channel d; the
  dense layer's input undoes it (its SmoothQuant smoother, or its float weight's column).
- K channel (g, d) is multiplied by T / a_k[g, d], where a_k is the larger range of d and its
  RoPE partner (RoPE rotates the pair, so both take one factor, which commutes with it); the
  query channels (h, d) of the heads reading g are divided by it, so q . k is unchanged.
a is the calibrated absmax of the projection's output channel, floored at T / FLOOR so that no
channel is blown up by more than FLOOR. Then K and V channels all span about T and s = T / 127.

The scale fits the calibrated ranges exactly, with no headroom: values beyond them saturate, so
calibrate on text like what will be served. Measured on SmolLM2 (2048 decoded tokens): the INT8
KV cache's cost falls from +1.4 points of perplexity to none measurable; room of 1.25x above
the ranges cost +0.6 point, and bounding a RoPE pair by what rotation can reach
(sqrt(a_d^2 + a_d'^2), never saturating) +0.2 point; docs/benchmarks.md.

Models that normalise q and k after the projection (Qwen3's q/k norms) are refused: the
calibrated ranges are taken before those norms.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...core.errors import ConversionError
from ...models.family import Family
from ...models.shape import AttentionShape
from ...targets.llmapi.checkpoint.unified import KV_SCALES as HF_KV_SCALES

#: No channel is multiplied by more than this.
FLOOR = 128.0


@dataclass(frozen=True)
class KVBalance:
    """One layer's rewrite: factors for the rows of the fused qkv output ([q | k | v]) and for
    the input channels of dense, and the KV cache scale."""

    qkv_rows: torch.Tensor  # float32 [(heads + 2 kv_heads) * head]
    dense_in: torch.Tensor  # float32 [heads * head]: dense's input channels come multiplied by it
    qkv_range: torch.Tensor  # float32 [] absmax of the rewritten qkv output (static scales)
    scale: torch.Tensor  # float32 [1]: kv_cache_scaling_factor


def shape_of(config: dict[str, Any]) -> tuple[int, int, int, int]:
    """(heads, kv_heads, head size, rotary dims) of a TensorRT-LLM config."""
    shape = AttentionShape.of(config)
    head = shape.head_size
    rotary = 0
    if config.get("position_embedding_type", "learned_absolute") != "learned_absolute":
        rotary = int(
            config.get("rotary_embedding_dim") or head * float(config.get("rotary_pct", 1.0))
        )
    return shape.heads, shape.kv_heads, head, rotary


def _split_ranges(
    ranges: torch.Tensor, config: dict[str, Any], pair: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The calibrated absmax of each qkv output row as q [heads, head], k and v [kv_heads,
    head], float32; each RoPE pair (d, d + rotary/2) of k given `pair` of its two ranges."""
    heads, kv_heads, head, rotary = shape_of(config)
    q_dim, kv_dim = heads * head, kv_heads * head
    if ranges.numel() != q_dim + 2 * kv_dim:
        raise ConversionError(
            f"the calibration has {ranges.numel()} qkv output channels, the config implies "
            f"{q_dim + 2 * kv_dim}: recalibrate this model (trt-builder calibrate --force)"
        )
    ranges = ranges.float()
    a_k = ranges[q_dim : q_dim + kv_dim].view(kv_heads, head).clone()
    half = rotary // 2
    if half:
        both = pair(a_k[:, :half], a_k[:, half:rotary])
        a_k[:, :half], a_k[:, half:rotary] = both, both
    return ranges[:q_dim].view(heads, head), a_k, ranges[q_dim + kv_dim :].view(kv_heads, head)


def balance(ranges: torch.Tensor, config: dict[str, Any], *, v_channels: bool = True) -> KVBalance:
    """The rewrite of one layer from the calibrated absmax of each qkv output row.

    `v_channels=False` gives all of V one factor: for INT8 weight-only checkpoints, whose dense
    weight is quantized per output row after the rewrite, where factors per input column would
    change its rounding (measured: +0.07 point teacher-forced, docs/benchmarks.md)."""
    heads, kv_heads, _, _ = shape_of(config)
    # a RoPE pair (d, d + rotary/2) takes one factor
    a_q, a_k, a_v = _split_ranges(ranges, config, torch.maximum)
    target = torch.maximum(a_k.amax(), a_v.amax()).clamp(min=1e-6)
    r_k = target / a_k.clamp(min=float(target) / FLOOR)
    r_v = target / a_v.clamp(min=float(target) / FLOOR)
    if not v_channels:
        r_v = torch.full_like(a_v, float(target / a_v.amax().clamp(min=float(target) / FLOOR)))
    group = heads // kv_heads  # query head h reads KV head h // group
    r_q = (1.0 / r_k).repeat_interleave(group, dim=0)
    rows = torch.cat([r_q.reshape(-1), r_k.reshape(-1), r_v.reshape(-1)])
    rewritten = torch.cat(
        [(a_q * r_q).reshape(-1), (a_k * r_k).reshape(-1), (a_v * r_v).reshape(-1)]
    )
    return KVBalance(
        qkv_rows=rows,
        dense_in=r_v.repeat_interleave(group, dim=0).reshape(-1),
        qkv_range=rewritten.amax(),
        scale=(target / 127.0).reshape(1),
    )


def qkv_ranges(stats: dict[str, torch.Tensor], sources: tuple[str, ...]) -> torch.Tensor:
    """The calibrated absmax of each output row of a fused qkv from its HF sources."""
    try:
        return torch.cat([stats[f"{s.removesuffix('.weight')}.output_absmax"] for s in sources])
    except KeyError as exc:
        raise ConversionError(
            f"the calibration has no statistics for {exc.args[0]}: recalibrate this model "
            "(trt-builder calibrate --force)"
        ) from None


def fp8_kv_scale(ranges: torch.Tensor, config: dict[str, Any]) -> torch.Tensor:
    """The FP8 KV cache's kv_cache_scaling_factor of one layer (float32 [1], a dequantization
    scale: the cache holds e4m3 of x / s) from the calibrated absmax of each qkv output row, by
    modelopt's convention (export_tensorrt_llm_checkpoint): max(amax_k, amax_v) / 448, never
    below 1.0. K is read after RoPE, which rotates each pair (d, d + rotary / 2): its bound is
    sqrt(a_d^2 + a_d'^2). No balancing: e4m3 is a float format, its relative step is the same
    at any magnitude its range covers."""
    a_k, a_v = kv_amax(ranges, config)
    return (torch.maximum(a_k, a_v) / 448.0).clamp(min=1.0).reshape(1)


def kv_amax(ranges: torch.Tensor, config: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(K's, V's) absmax over the layer (float32 scalars) from the calibrated absmax of each
    qkv output row: V's as calibrated, K's after RoPE, which rotates each pair (d, d +
    rotary / 2): its bound is sqrt(a_d^2 + a_d'^2)."""
    _, a_k, a_v = _split_ranges(ranges, config, torch.hypot)
    return a_k.amax(), a_v.amax()


def refuse_unsupported(
    config: dict[str, Any], family: Family, names: set[str], kv_cache: str = "int8"
) -> None:
    """A quantized KV cache needs ranges of what the cache holds: refuse the families whose
    registry entry says it does not apply, and (whatever the entry says) a checkpoint with q/k
    norms after the projections."""
    normed = any(n.endswith("attention.k_layernorm.weight") for n in names)
    if not family.int8_kv_cache or normed:
        raise ConversionError(
            f"--kv-cache {kv_cache} is not supported for {config['architecture']} (q/k norms "
            f"after the projections) yet: drop --kv-cache {kv_cache}"
        )


class KVCacheScales:
    """The quantized KV cache of one conversion, for every converter and target: built once per
    conversion (`of`), it refuses what the mode or the model cannot run, reads the calibration,
    and gives each layer its INT8 balancing (`balance`) and its kv_cache_scaling_factor
    (`scale`), or the llmapi target's k_scale / v_scale (`hf_scales`). `kind` is the mode's
    --kv-cache choice (modes/kvcache/spec.py); "model" writes nothing."""

    def __init__(self, kind: str, config: dict[str, Any], stats: dict[str, torch.Tensor]) -> None:
        self.kind, self.config, self.stats = kind, config, stats

    @classmethod
    def of(cls, mode: Any, config: dict[str, Any], family: Family, names: set[str],
           calibration: Path | None, *,
           stats: dict[str, torch.Tensor] | None = None) -> KVCacheScales:  # fmt: skip
        """The KV cache of `mode` (a spec.modes.Mode) for a model of `family` whose checkpoint
        tensors are `names`, from `calibration` (or its `stats`, already loaded)."""
        if mode.kv_cache == "model":
            return cls("model", config, {})
        refusal = mode.kv_refusal()  # BuildSpec refuses it first; this is for library callers
        if refusal:
            raise ConversionError(refusal)
        refuse_unsupported(config, family, names, mode.kv_cache)
        if stats is None:
            if calibration is None:
                raise ConversionError(
                    f"the {mode.kv_cache_quant_algo} KV cache needs a calibration: run "
                    "trt-builder calibrate"
                )
            from ...calibrate.stats import load_stats

            stats = load_stats(calibration)
        return cls(mode.kv_cache, config, stats)

    def balance(self, sources: tuple[str, ...], *, v_channels: bool = True) -> KVBalance | None:
        """The INT8 KV cache's rewrite of a layer whose fused qkv is made of `sources` (None for
        any other cache)."""
        if self.kind != "int8":
            return None
        return balance(qkv_ranges(self.stats, sources), self.config, v_channels=v_channels)

    def scale(
        self, sources: tuple[str, ...], balanced: KVBalance | None = None
    ) -> torch.Tensor | None:
        """A layer's kv_cache_scaling_factor (float32 [1]): the INT8 cache's from its balancing
        (`balanced`), the FP8 cache's from the calibrated ranges; None for the model dtype's."""
        if self.kind == "int8":
            assert balanced is not None
            return balanced.scale
        if self.kind == "fp8":
            return fp8_kv_scale(qkv_ranges(self.stats, sources), self.config)
        return None

    def hf_scales(self, rules: list[Any]) -> dict[str, torch.Tensor]:
        """The FP8 KV cache's k_scale and v_scale per layer of a Hugging Face checkpoint (the
        llmapi target), by modelopt's unified export: K's and V's amax / 448, float32 scalars,
        not clamped, K's amax taken after RoPE (kv_amax)."""
        out: dict[str, torch.Tensor] = {}
        if self.kind != "fp8":
            return out
        for rule in rules:
            if not rule.name.endswith(".attention.qkv.weight"):
                continue
            amax = kv_amax(qkv_ranges(self.stats, rule.sources), self.config)
            for source, scale_name, a in zip(rule.sources[1:], HF_KV_SCALES, amax, strict=True):
                prefix = source.removesuffix(".weight").rsplit(".", 1)[0]  # ...self_attn
                out[f"{prefix}.{scale_name}"] = (a / torch.full_like(a, 448.0)).reshape(())
        return out
