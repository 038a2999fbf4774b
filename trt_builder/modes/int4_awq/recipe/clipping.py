"""Clipped INT4 group scales (AWQ's auto_clip, scored with the input Hessian): each group of a
row takes the scale r * absmax / 7 of the ratio r on awq's grid (1, 0.95, ..., 0.55: its
`max_shrink` 0.5 over `n_grid` 20) whose rounding to nearest has the least output error on the
fit tokens, d H_gg d^T, with d the group's weights less their dequantized values and H_gg the
group's block of the GEMM input's Hessian (the interactions between groups left out, as
auto_clip leaves them). A smaller scale clips the group's largest weights (to -8 or 7) and
rounds all the others finer. Only the scale changes: the format is the checkpoint's own.
"""

from __future__ import annotations

import torch

from ....checkpoint.int4 import INT4_MAX
from ..checkpoint import CLIP_RATIOS


def clipped_scales(
    weight: torch.Tensor, hessian: torch.Tensor, group: int, dtype: torch.dtype
) -> torch.Tensor:
    """float32 scales [out, in / group] of `weight` [out, in] (W / p, the GEMM's weights),
    each group's ratio chosen against `hessian` [in, in] (of the GEMM's input, x * p), the
    dequantized value as the engine computes it (scale and product in `dtype`)."""
    out, width = weight.shape
    groups = width // group
    w = weight.float().reshape(out, groups, group)
    blocks = (
        hessian.float()
        .reshape(groups, group, groups, group)
        .diagonal(dim1=0, dim2=2)  # [group, group, groups]
        .permute(2, 0, 1)
        .contiguous()
    )
    amax = w.abs().amax(-1)
    best = (amax / INT4_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    least = torch.full_like(amax, float("inf"))
    for ratio in CLIP_RATIOS:
        scales = (amax * ratio / INT4_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        values = (w / scales[..., None]).round().clamp(-8, 7)
        d = w - (values * scales.to(dtype).float()[..., None]).to(dtype).float()
        error = ((d.transpose(0, 1) @ blocks).transpose(0, 1) * d).sum(-1)  # [out, groups]
        better = error < least
        least = torch.where(better, error, least)
        best = torch.where(better, scales, best)
    return best
