"""GPTQ's column update (Frantar et al., 2022) on a fixed grid at fixed scales, for the formats
whose scales are set before the rounding (INT4 groups, NVFP4 blocks): each column is rounded to
the grid at its own scale and its error spread over the columns not yet rounded, in proportion
to the inverse Hessian H = X^T X of the GEMM's input (Cholesky form), columns in order of
decreasing H diagonal (act-order). Only which grid value each weight takes changes; the scales,
and so the checkpoint's format, are those of rounding to nearest. Batched over GEMMs of one
shape. FP8's per-tensor e4m3 rounding is the same update (modes/fp8/recipe/rounding.py, whose
shares this module's Cholesky factor).

Written here, not taken from a GPTQ library: those fit their own scales as they go, on integer
grids, inside their model wrappers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


@contextmanager
def tf32() -> Iterator[None]:
    """float32 matrix products on CUDA in TF32 while inside (the CPU is untouched): for error
    sums that rank candidates, where TF32's 1e-3 relative error changes no ranking that
    matters and the tensor cores do the work several times faster."""
    matmul = torch.backends.cuda.matmul
    setting = "fp32_precision" if hasattr(matmul, "fp32_precision") else "allow_tf32"  # < 2.9
    before = getattr(matmul, setting)
    setattr(matmul, setting, "tf32" if setting == "fp32_precision" else True)
    try:
        yield
    finally:
        setattr(matmul, setting, before)


def inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor U of the dampened H's inverse (H^-1 = U^T U), [batch, k, k];
    more dampening where H is too ill-conditioned for the factorisation. With J the reversal
    of rows and columns, J H J = L L^T gives U = J L^-1 J: one factorisation and one
    triangular inverse, where GPTQ's chol(cholesky_inverse(chol(H))) takes three (5x slower
    on the CPU, the same U to 1e-11)."""
    eye = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device)
    mean = torch.diagonal(h, dim1=1, dim2=2).mean(1)[:, None, None]
    flipped = h.flip(-1, -2)
    for tries in range(6):
        factor, info = torch.linalg.cholesky_ex(flipped + damp * 10**tries * mean * eye)
        if not bool(info.any()):
            break
    return torch.linalg.solve_triangular(factor, eye.expand_as(factor), upper=False).flip(-1, -2)


def working_set(n: int, k: int, itemsize: int) -> tuple[int, int]:
    """Bytes a batched update of GEMMs [n, k] holds: (per GEMM: its Hessian and inverse factor,
    and about six n x k tensors of weights, steps and values, with the caller's stacked inputs;
    once: one GEMM's Cholesky temporaries, ordered_inverse's)."""
    return (2 * k * k + 6 * n * k) * itemsize, 6 * k * k * itemsize


def ordered_inverse(
    hessians: torch.Tensor, dtype: torch.dtype, damp: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(act-order [batch, k]: each GEMM's inputs by decreasing H diagonal; the upper Cholesky
    factor of each dampened H^-1 in that order [batch, k, k]) of Hessians [batch, k, k], one
    GEMM at a time, so that what it holds beyond the result is one GEMM's temporaries (a
    batch's at once would be several k x k per GEMM). An input that never fired (a zero
    diagonal: H's row and column 0) gets diagonal 1, so its column is rounded to nearest."""
    b, k, _ = hessians.shape
    order = torch.argsort(torch.diagonal(hessians, dim1=1, dim2=2), dim=1, descending=True)
    hinv = torch.empty(b, k, k, dtype=dtype, device=hessians.device)
    for j in range(b):
        h = hessians[j].to(dtype)[order[j]][:, order[j]]
        h.diagonal().add_((h.diagonal() == 0).to(dtype))
        hinv[j] = inverse_cholesky(h[None], damp)[0]
        del h
    return order, hinv


def compensated_on_grid(
    weights: torch.Tensor,
    hessians: torch.Tensor,
    steps: torch.Tensor,
    to_grid: Callable[[torch.Tensor], torch.Tensor],
    *,
    damp: float = 0.01,
    block: int = 128,
) -> torch.Tensor:
    """The grid values [batch, out, in] (in units of each weight's step) of weights [batch,
    out, in], each weight's step (its scale) in `steps` [batch, out, in], `to_grid` rounding
    values in units of the step to the grid's nearest; each rounding chosen against its GEMM's
    output on inputs with Hessians [batch, in, in]. float64 on the CPU, float32 on a GPU."""
    dtype = torch.float64 if weights.device.type == "cpu" else torch.float32
    b, n, k = weights.shape
    order, hinv = ordered_inverse(hessians, dtype, damp)
    index = order[:, :, None].expand(b, k, n)
    # transposed, [b, k, n]: an input channel's weights together
    w = weights.to(dtype).transpose(1, 2).gather(1, index)
    step = steps.to(dtype).transpose(1, 2).gather(1, index)
    for start in range(0, k, block):
        stop = min(start + block, k)
        diagonal = torch.diagonal(hinv[:, start:stop, start:stop], dim1=1, dim2=2)
        rows = hinv[:, start:stop, start:stop] / diagonal[:, :, None]  # row i: 1 at column i
        w1, s1 = w[:, start:stop], step[:, start:stop]
        err = torch.empty_like(w1)
        for i in range(stop - start):
            channel = w1[:, i]
            rounded = to_grid(channel / s1[:, i]) * s1[:, i]
            torch.sub(channel, rounded, out=err[:, i])
            # spread the error over this block's channels still to round; channel i itself
            # becomes its grid value (its row holds 1 there)
            w1[:, i:].addcmul_(rows[:, i, i:, None], err[:, i, None], value=-1)
        err /= diagonal[:, :, None]
        w[:, stop:] -= hinv[:, start:stop, stop:].transpose(1, 2) @ err
    values = to_grid(w / step)
    back = torch.argsort(order, dim=1)[:, :, None].expand(b, k, n)
    return values.gather(1, back).transpose(1, 2).contiguous()
