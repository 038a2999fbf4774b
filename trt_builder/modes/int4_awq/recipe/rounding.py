"""Error-compensated rounding of INT4 weights at fixed group scales: GPTQ's column-by-column
update (Frantar et al., 2022) with round-to-nearest at each weight's group scale (absmax / 7 of
its group of W / p, as convert computes it), so the checkpoint's format, group scales and
pre-quantization scales are those of plain rounding; only which INT4 value each weight takes
changes.

The FP8 rounding's update (modes/fp8/recipe/rounding.py, whose Cholesky factor this shares):
each column is rounded and its error spread over the columns not yet rounded, in proportion to
the inverse Hessian H = X^T X of the GEMM's input (here the input times the pre-quantization
scale p, the GEMM's real input: diag(p) H diag(p)), in order of decreasing H diagonal
(act-order); the group scales stay those of the columns' own groups (GPTQ's "static groups").
Batched over GEMMs of one shape.

Written here, not taken from a GPTQ library: those fit their own group scales as they go and
need their model wrappers; the checkpoint's scales here are convert's.
"""

from __future__ import annotations

import torch

from ...fp8.recipe.rounding import _inverse_cholesky

INT4_MIN, INT4_MAX = -8, 7


def compensated_int4(
    weights: torch.Tensor,
    hessians: torch.Tensor,
    scales: torch.Tensor,
    *,
    damp: float = 0.01,
    block: int = 128,
) -> torch.Tensor:
    """int8 values -8..7 [batch, out, in] of weights [batch, out, in] (W / p) at their group
    scales [batch, out, in / group], each rounding chosen against its GEMM's output on inputs
    with Hessians [batch, in, in] (of the scaled input x * p). float64 on the CPU, float32 on a
    GPU."""
    dtype = torch.float64 if weights.device.type == "cpu" else torch.float32
    b, n, k = weights.shape
    group = k // scales.shape[2]
    h = hessians.to(dtype)
    diag = torch.diagonal(h, dim1=1, dim2=2)
    order = torch.argsort(diag, dim=1, descending=True)  # [b, k]
    step = scales.float().repeat_interleave(group, dim=2).to(dtype).transpose(1, 2)  # [b, k, n]
    w = weights.to(dtype).transpose(1, 2)  # [b, k, n]: an input channel's weights together
    index = order[:, :, None].expand(b, k, n)
    w, step = w.gather(1, index), step.gather(1, index)
    h = h.gather(1, order[:, :, None].expand(b, k, k)).gather(2, order[:, None, :].expand(b, k, k))
    dead = torch.diagonal(h, dim1=1, dim2=2) == 0  # inputs that never fired
    hinv = _inverse_cholesky(h + torch.diag_embed(dead.to(dtype)), damp)
    del h
    for start in range(0, k, block):
        stop = min(start + block, k)
        diagonal = torch.diagonal(hinv[:, start:stop, start:stop], dim1=1, dim2=2)
        rows = hinv[:, start:stop, start:stop] / diagonal[:, :, None]
        w1, s1 = w[:, start:stop], step[:, start:stop]
        err = torch.empty_like(w1)
        for i in range(stop - start):
            channel = w1[:, i]
            rounded = (channel / s1[:, i]).round().clamp(INT4_MIN, INT4_MAX) * s1[:, i]
            torch.sub(channel, rounded, out=err[:, i])
            w1[:, i:].addcmul_(rows[:, i, i:, None], err[:, i, None], value=-1)
        err /= diagonal[:, :, None]
        w[:, stop:] -= hinv[:, start:stop, stop:].transpose(1, 2) @ err
    q = (w / step).round().clamp(INT4_MIN, INT4_MAX)
    back = torch.argsort(order, dim=1)[:, :, None].expand(b, k, n)
    return q.gather(1, back).transpose(1, 2).to(torch.int8).contiguous()
