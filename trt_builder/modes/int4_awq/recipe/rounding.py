"""Error-compensated rounding of INT4 weights at fixed group scales: GPTQ's update
(recipe/gptq.py) on the INT4 grid -8..7, each weight at its group's scale (absmax / 7 of its
group of W / p, as convert computes it), so the checkpoint's format, group scales and
pre-quantization scales are those of plain rounding; only which INT4 value each weight takes
changes. The Hessian is that of the GEMM's real input, the input times p: diag(p) H diag(p)
(the search passes it so)."""

from __future__ import annotations

import torch

from ....recipe.gptq import compensated_on_grid

INT4_MIN, INT4_MAX = -8, 7


def _int4_grid(values: torch.Tensor) -> torch.Tensor:
    return values.round().clamp(INT4_MIN, INT4_MAX)


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
    with Hessians [batch, in, in] (of the scaled input x * p)."""
    group = weights.shape[2] // scales.shape[2]
    steps = scales.float().repeat_interleave(group, dim=2)
    values = compensated_on_grid(weights, hessians, steps, _int4_grid, damp=damp, block=block)
    return values.to(torch.int8)
