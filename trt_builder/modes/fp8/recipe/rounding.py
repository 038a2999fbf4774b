"""Error-compensated rounding of FP8 weights: GPTQ's column-by-column update (Frantar et al.,
2022) with e4m3 rounding at a fixed per-tensor scale, so the checkpoint's format and scales are
those of plain rounding; only which e4m3 neighbour each weight takes changes.

Each column is rounded to e4m3 and its rounding error is spread over the columns not yet
rounded, in proportion to the inverse Hessian H = X^T X of the GEMM's input (Cholesky form),
which minimises the error of W X rather than of W. Columns go in order of decreasing H
diagonal (GPTQ's act-order: the busiest inputs first, while the most columns are left to
absorb their error); a column whose input never fired (a zero diagonal) is rounded to nearest.
Batched over GEMMs of one shape (a model's layers), so a step is one kernel for all of them.

Written here because the GPTQ libraries (auto-gptq, gptqmodel, llm-compressor) round to
integer grids with per-group scales and would need their model wrappers; e4m3 at one scale is
the twenty lines below.
"""

from __future__ import annotations

import torch

from ....checkpoint.fp8 import E4M3, FP8_MAX
from ....recipe.gptq import ordered_inverse


def compensated_e4m3(
    weights: torch.Tensor,
    hessians: torch.Tensor,
    scales: torch.Tensor,
    *,
    damp: float = 0.01,
    block: int = 128,
) -> torch.Tensor:
    """e4m3 of weights [batch, out, in] / scales [batch], each weight's rounding chosen against
    its GEMM's output on inputs with Hessians [batch, in, in]. float64 on the CPU, float32 on a
    GPU (as GPTQ runs)."""
    dtype = torch.float64 if weights.device.type == "cpu" else torch.float32
    b, n, k = weights.shape
    order, hinv = ordered_inverse(hessians, dtype, damp)  # act-order, [b, k]
    # transposed, [b, k, n], so that an input channel's weights lie together; in units of the
    # scale, divided in float32 as plain rounding divides: a channel no error reaches rounds
    # exactly as convert rounds it
    w = (weights.float() / scales.float().reshape(b, 1, 1)).to(dtype).transpose(1, 2)
    w = w.gather(1, order[:, :, None].expand(b, k, n))
    for start in range(0, k, block):
        stop = min(start + block, k)
        diagonal = torch.diagonal(hinv[:, start:stop, start:stop], dim1=1, dim2=2)
        rows = hinv[:, start:stop, start:stop] / diagonal[:, :, None]  # row i: 1 at column i
        w1 = w[:, start:stop]  # a view: the channels are rounded in place
        err = torch.empty_like(w1)
        for i in range(stop - start):
            channel = w1[:, i]
            rounded = channel.clamp(-FP8_MAX, FP8_MAX).to(E4M3).to(dtype)
            torch.sub(channel, rounded, out=err[:, i])
            # spread the error over this block's channels still to round; channel i itself
            # becomes its e4m3 value (its row holds 1 there)
            w1[:, i:].addcmul_(rows[:, i, i:, None], err[:, i, None], value=-1)
        err /= diagonal[:, :, None]
        w[:, stop:] -= hinv[:, start:stop, stop:].transpose(1, 2) @ err
    q = w.clamp(-FP8_MAX, FP8_MAX).to(E4M3).view(torch.uint8)  # every channel its e4m3 value
    back = torch.argsort(order, dim=1)[:, :, None].expand(b, k, n)
    return q.gather(1, back).transpose(1, 2).contiguous().view(E4M3)  # no float8 gather
