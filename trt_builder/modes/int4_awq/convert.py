"""W4A16 AWQ (`quant_algo: W4A16_AWQ`) in TensorRT-LLM's checkpoint format.

Per decoder layer, for each GEMM TensorRT-LLM's WeightOnlyGroupwiseQuantLinear replaces (qkv,
dense, fc, gate, proj):
- `prequant_scaling_factor`: AWQ's per-input-channel scale p, in the model dtype ([in]): the
  engine multiplies the GEMM's input by it (rounded to the model dtype), so the weight is
  stored as W / p, and channels whose activations are large get a finer grid;
- `weights_scaling_factor`: float32 [out, in / group], each group's absmax of W / p over 7;
- `weight`: the INT4 values of W / p at those scales, packed two per byte along the output
  rows (checkpoint/int4.py), each rank packing its own.

p = 1 / s with s_k = a_k^alpha / w_k^(1 - alpha) (AWQ's form): a_k the calibrated RMS of input
channel k, w_k the mean over rows of |W[:, k]| relative to its group's absmax, normalised so
that max(s) * min(s) = 1; alpha is chosen per linear on the grid 0, 0.1, ..., 1 (0: plain
rounding) to minimise the calibrated output error of the rounding, sum_k E[x_k^2] *
sum_n (W[n, k] - p_k * Q(W / p)[n, k])^2 (channels taken as uncorrelated: the calibration keeps
each channel's mean square, not their covariance). Norms, biases, the embedding, ln_f and
lm_head stay in the model dtype, as `exclude_modules` says. With the FP8 KV cache each layer
gets `kv_cache_scaling_factor` (modes/kvcache/convert.py).

Written by hand: TensorRT-LLM's quantize scripts need TensorRT-LLM and a GPU, and modelopt is a
test oracle here, not a dependency.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from ...calibrate.stats import load_stats
from ...checkpoint.fp8 import FP8_LINEARS
from ...checkpoint.int4 import dequantize, group_scales, pack_rows, quantize_groups
from ...checkpoint.mapping import Mapping
from ...convert.dispatch import register
from ...convert.layers import LayerJob, split_layers
from ...convert.plan import plan_conversion
from ...convert.write import finish
from ...core.dtypes import torch_dtype
from ...core.errors import ConversionError, SpecError
from ...models.shape import AttentionShape
from .. import FloatMode
from ..kvcache.convert import KVCacheScales
from .spec import Int4Awq

#: The GEMMs stored as INT4 (TensorRT-LLM names within a decoder layer): FP8's five.
INT4_LINEARS = FP8_LINEARS
#: What config.json's exclude_modules lists: the modules kept in the model dtype.
EXCLUDED = ["lm_head", "transformer.vocab_embedding"]
#: AWQ's exponents tried per linear (awq_lite's grid).
ALPHAS = tuple(i / 10 for i in range(11))


def linear_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Each quantized linear's (out, in) features, whole (TensorRT-LLM names)."""
    hidden = int(config["hidden_size"])
    attention = AttentionShape.of(config)
    inter = int(config.get("intermediate_size") or 4 * hidden)
    q = attention.heads * attention.head_size
    qkv = q + 2 * attention.kv_heads * attention.head_size
    return {"attention.qkv": (qkv, hidden), "attention.dense": (hidden, q),
            "mlp.fc": (inter, hidden), "mlp.proj": (hidden, inter)}  # fmt: skip


def _awq_scale(
    weight: torch.Tensor, sqmean: torch.Tensor, alpha: float, group: int
) -> torch.Tensor:
    """AWQ's s for `alpha` ([in], in float64: the model-dtype scale it becomes is then the same
    whatever CPU computes it, its float32 pow and sums an ulp apart or not)."""
    out, width = weight.shape
    grouped = weight.double().abs().reshape(out, width // group, group)
    relative = (grouped / grouped.amax(-1, keepdim=True).clamp(min=1e-12)).reshape(out, width)
    w_mag = relative.mean(0).clamp(min=1e-4)
    a_mag = sqmean.double().sqrt().clamp(min=1e-4)
    s = (a_mag.pow(alpha) / w_mag.pow(1 - alpha)).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def _rounded(weight: torch.Tensor, pqs: torch.Tensor, group: int, dtype: torch.dtype) -> Any:
    """(INT4 values, scales, the weight the engine computes with) of `weight` under the
    model-dtype pre-quantization scale `pqs`."""
    scaled = weight / pqs.float()
    scales = group_scales(scaled, group)
    values = quantize_groups(scaled, scales)
    return values, scales, dequantize(values, scales, dtype) * pqs.float()


def awq_linear(
    weight: torch.Tensor, sqmean: torch.Tensor, group: int, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], float, float]:
    """One linear's INT4 tensors (weight values unpacked, weights_scaling_factor,
    prequant_scaling_factor), the alpha chosen and its calibrated error relative to plain
    rounding's."""
    weight = weight.to(dtype).float()  # the model modelopt would load
    best: tuple[float, float, Any] | None = None
    plain = None
    for alpha in ALPHAS:
        pqs = (1.0 / _awq_scale(weight, sqmean, alpha, group)).to(dtype)
        values, scales, effective = _rounded(weight, pqs, group, dtype)
        error = float(((weight - effective).double().square() * sqmean.double()).sum())
        if plain is None:
            plain = error
        if best is None or error < best[1]:
            best = (alpha, error, (values, scales, pqs))
    assert best is not None and plain is not None
    values, scales, pqs = best[2]
    tensors = {"weight": values, "weights_scaling_factor": scales, "prequant_scaling_factor": pqs}
    return tensors, best[0], best[1] / plain if plain else 1.0


def convert_int4_awq(
    hf_dir: Path,
    out_dir: Path,
    mode: Int4Awq,
    calibration: Path,
    *,
    tp: int = 1,
    pp: int = 1,
    remember: Callable[[Path, str], None] | None = None,
) -> dict[str, Any]:
    """Convert `hf_dir` with the statistics in `calibration` into a W4A16 AWQ checkpoint."""
    family, config, rules, index, notes = plan_conversion(
        hf_dir, FloatMode(mode.dtype), tp=tp, pp=pp
    )
    chosen: dict[str, float] = {}
    ratios: list[float] = []
    with ExitStack() as stack:
        stack.enter_context(index)  # closed on every way out, refusals included
        try:
            group = mode.group_for(linear_shapes(config), tp)
        except SpecError as exc:
            raise ConversionError(str(exc)) from None
        stats = load_stats(calibration)
        kv_cache = KVCacheScales.of(mode, config, family, {r.name for r in rules}, calibration,
                                    stats=stats)  # fmt: skip
        layers, others = split_layers(rules)
        config["quantization"].update(
            quant_algo=mode.quant_algo,
            kv_cache_quant_algo=mode.kv_cache_quant_algo,
            group_size=group,
            has_zero_point=False,
            pre_quant_scale=True,
            exclude_modules=list(EXCLUDED),
        )
        dtype = torch_dtype(mode.dtype)

        def tensors(
            i: int, floats: dict[str, torch.Tensor], sources: dict[str, tuple[str, ...]]
        ) -> dict[str, torch.Tensor]:
            out: dict[str, torch.Tensor] = {}
            for name, tensor in floats.items():
                if name not in INT4_LINEARS:  # norms, biases, q/k norms
                    out[name] = tensor.to(dtype)
                    continue
                base = name.removesuffix(".weight")
                if tensor.is_meta:  # the plan: shapes and dtypes alone
                    rows, width = tensor.shape
                    out[name] = torch.empty(rows, width, dtype=torch.int8, device="meta")
                    out[f"{base}.weights_scaling_factor"] = torch.empty(
                        rows, width // group, device="meta"
                    )
                    out[f"{base}.prequant_scaling_factor"] = torch.empty(
                        width, dtype=dtype, device="meta"
                    )
                    continue
                module = sources[name][0].removesuffix(".weight")  # q/k/v share one input
                sqmean = _sqmean(stats, module).to(tensor.device)
                linear, alpha, ratio = awq_linear(tensor, sqmean, group, dtype)
                chosen[f"transformer.layers.{i}.{base}"] = alpha
                ratios.append(ratio)
                out.update({f"{base}.{k}": v for k, v in linear.items()})
            scale = kv_cache.scale(sources["attention.qkv.weight"])
            if scale is not None:
                out["attention.kv_cache_scaling_factor"] = scale.to(
                    floats["attention.qkv.weight"].device
                )
            return out

        job = LayerJob(tensors, layers, others, index, dtype, Mapping.from_config(config),
                       "cpu", per_rank=_pack)  # fmt: skip
        written = job.write(stack, out_dir, remember)
    record = finish(out_dir, config, family, tensors=written, notes=notes)
    alphas = sorted(set(chosen.values()))
    record["awq"] = {
        "group_size": group,
        "alphas": {str(a): sum(1 for v in chosen.values() if v == a) for a in alphas},
        "error_vs_plain_rounding": round(sum(ratios) / len(ratios), 4) if ratios else None,
    }
    return record


def _pack(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A rank's INT4 values, packed (its other tensors as they are)."""
    return pack_rows(tensor) if tensor.dtype == torch.int8 else tensor


def _sqmean(stats: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    try:
        return stats[f"{module}.input_sqmean"]
    except KeyError:
        raise ConversionError(
            f"the calibration has no input_sqmean for {module}: recalibrate this model "
            "(trt-builder calibrate --force)"
        ) from None


@register(Int4Awq)
def _int4_awq(mode: Int4Awq, hf_dir: Path, out_dir: Path, *, tp: int, pp: int,
              calibration: Path | None, recipe: Path | None = None,
              remember: Callable[[Path, str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    assert calibration is not None  # AWQ always calibrates: its scales
    return convert_int4_awq(hf_dir, out_dir, mode, calibration, tp=tp, pp=pp, remember=remember)
