"""AWQ's arithmetic for W4A16 AWQ, shared by convert (modes/int4_awq/convert.py) and the
recipe's search (recipe/search.py): each GEMM's pre-quantization scale p = 1 / s from an
exponent alpha (s_k = a_k^alpha / w_k^(1 - alpha), AWQ's form), and the INT4 values and group
scales of W / p (checkpoint/int4.py's format)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...checkpoint.int4 import dequantize, group_scales, quantize_groups
from ...models.shape import AttentionShape

#: AWQ's exponents tried per linear (awq_lite's grid).
ALPHAS = tuple(i / 10 for i in range(11))


#: AWQ's auto_clip grid (its max_shrink 0.5 over n_grid 20): the ratios of a group's absmax a
#: searched group scale may take (recipe/clipping.py chooses; convert checks a recipe by them).
CLIP_RATIOS = tuple(1 - i / 20 for i in range(10))


def linear_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Each quantized linear's (out, in) features, whole (TensorRT-LLM names)."""
    hidden = int(config["hidden_size"])
    attention = AttentionShape.of(config)
    inter = int(config.get("intermediate_size") or 4 * hidden)
    q = attention.heads * attention.head_size
    qkv = q + 2 * attention.kv_heads * attention.head_size
    return {"attention.qkv": (qkv, hidden), "attention.dense": (hidden, q),
            "mlp.fc": (inter, hidden), "mlp.proj": (hidden, inter)}  # fmt: skip


def _magnitudes(
    weight: torch.Tensor, sqmean: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What AWQ's s depends on besides alpha, [in] each, in float64 (the model-dtype scale it
    becomes is then the same whatever CPU computes it, its float32 pow and sums an ulp apart or
    not): each input channel's mean weight magnitude relative to its group's absmax, and its
    activation's root mean square."""
    out, width = weight.shape
    grouped = weight.double().abs().reshape(out, width // group, group)
    relative = (grouped / grouped.amax(-1, keepdim=True).clamp(min=1e-12)).reshape(out, width)
    return relative.mean(0).clamp(min=1e-4), sqmean.double().sqrt().clamp(min=1e-4)


def _pqs_of(magnitudes: tuple[torch.Tensor, torch.Tensor], alpha: float | None,
            width: int, dtype: torch.dtype, device: Any) -> torch.Tensor:  # fmt: skip
    """p = 1 / s of `alpha` in `dtype`, s = a^alpha / w^(1 - alpha) normalised (None: ones)."""
    if alpha is None:
        return torch.ones(width, dtype=dtype, device=device)
    w_mag, a_mag = magnitudes
    s = (a_mag.pow(alpha) / w_mag.pow(1 - alpha)).clamp(min=1e-4)
    return (1.0 / (s / (s.max() * s.min()).sqrt())).to(dtype)


def awq_pqs(
    weight: torch.Tensor, sqmean: torch.Tensor, alpha: float | None, group: int, dtype: torch.dtype
) -> torch.Tensor:
    """The pre-quantization scale p = 1 / s of `alpha` in `dtype` (None: no scale, ones)."""
    if alpha is None:
        return torch.ones(weight.shape[1], dtype=dtype, device=weight.device)
    return _pqs_of(_magnitudes(weight, sqmean, group), alpha, weight.shape[1], dtype,
                   weight.device)  # fmt: skip


def rounded_at(weight: torch.Tensor, pqs: torch.Tensor, group: int, dtype: torch.dtype) -> Any:
    """(INT4 values, scales, the weight the engine computes with) of `weight` under the
    model-dtype pre-quantization scale `pqs`."""
    scaled = weight / pqs.float()
    scales = group_scales(scaled, group)
    values = quantize_groups(scaled, scales)
    return values, scales, dequantize(values, scales, dtype) * pqs.float()


def awq_linear(
    weight: torch.Tensor,
    sqmean: torch.Tensor,
    group: int,
    dtype: torch.dtype,
    each: Callable[[float | None, torch.Tensor, torch.Tensor], None] | None = None,
) -> tuple[dict[str, torch.Tensor], float | None, float]:
    """One linear's INT4 tensors (weight values unpacked, weights_scaling_factor,
    prequant_scaling_factor), the alpha chosen (None: plain rounding) and its calibrated error
    relative to plain rounding's. `each(alpha, pqs, effective)` sees every alpha tried (the
    search scores them its own way in the same pass: AWQ's magnitudes and each rounding are
    computed once)."""
    weight = weight.to(dtype).float()  # the model modelopt would load
    magnitudes = _magnitudes(weight, sqmean, group)
    best: tuple[float | None, float, Any] | None = None
    plain = None
    for alpha in (None, *ALPHAS):
        pqs = _pqs_of(magnitudes, alpha, weight.shape[1], dtype, weight.device)
        values, scales, effective = rounded_at(weight, pqs, group, dtype)
        if each is not None:
            each(alpha, pqs, effective)
        error = float(((weight - effective).double().square() * sqmean.double()).sum())
        if plain is None:
            plain = error
        if best is None or error < best[1]:
            best = (alpha, error, (values, scales, pqs))
    assert best is not None and plain is not None
    values, scales, pqs = best[2]
    tensors = {"weight": values, "weights_scaling_factor": scales, "prequant_scaling_factor": pqs}
    return tensors, best[0], best[1] / plain if plain else 1.0
