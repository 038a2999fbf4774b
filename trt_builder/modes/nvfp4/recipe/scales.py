"""Searched NVFP4 block scales: each block takes, of its candidates (modes/nvfp4/checkpoint.py: the
e4m3 grid around absmax / (6 s2)), the scale whose nearest e2m1 rounding has the least output
error on the fit tokens, d H_bb d^T, d the block's weights less their dequantized values, H_bb
the block's 16 x 16 of the GEMM input's Hessian (the interactions between blocks left out, as
AWQ's auto_clip leaves them between groups). The convert's own scale is kept on a tie, and an
all-zero block keeps 1. Only the scales change: the format is the checkpoint's own.
"""

from __future__ import annotations

import torch

from ....checkpoint import nvfp4
from ..checkpoint import candidates


def searched_scales(
    weight: torch.Tensor, hessian: torch.Tensor, scale_2: torch.Tensor
) -> torch.Tensor:
    """float8_e4m3fn [out, in / 16] block scales of `weight` [out, in] at global scale
    `scale_2`, each chosen against `hessian` [in, in] (of the GEMM's input)."""
    out, width = weight.shape
    blocks = width // nvfp4.BLOCK
    w = weight.float().reshape(out, blocks, nvfp4.BLOCK)
    h = (
        hessian.float()
        .reshape(blocks, nvfp4.BLOCK, blocks, nvfp4.BLOCK)
        .diagonal(dim1=0, dim2=2)  # [16, 16, blocks]
        .permute(2, 0, 1)
        .contiguous()
    )
    nearest = nvfp4.block_scales(weight, scale_2)
    best = nearest.view(torch.uint8).clone()
    least = torch.full((out, blocks), float("inf"), device=weight.device)
    # the nearest scale first: another must do strictly better to replace it
    for scales in (nearest, *candidates(nearest).unbind()):
        step = scales.float() * scale_2.float()
        values = nvfp4.round_e2m1(w / step[..., None]) * step[..., None]
        d = w - values
        error = ((d.transpose(0, 1) @ h).transpose(0, 1) * d).sum(-1)  # [out, blocks]
        better = error < least
        least = torch.where(better, error, least)
        best = torch.where(better, scales.view(torch.uint8), best)
    zero = w.abs().amax(-1) == 0
    best = torch.where(zero, nearest.view(torch.uint8), best)
    return best.view(torch.float8_e4m3fn)
