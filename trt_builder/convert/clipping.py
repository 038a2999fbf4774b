"""INT8 weight-only clipping: each weight row clamped where that lowers the output error.

trtllm-build quantizes a W8A16 checkpoint's float weights itself, per output row j: scale =
amax_j / 128 in the activation dtype, q = clamp(round(w / scale), -128, 127) (the checkpoint
runtime's `weight_only_int8`). One outlier sets the step of its whole row. Written clamped to
+-r * amax_j, the row is quantized by the builder on the grid of r * amax_j / 128: the outliers
lose up to (1 - r) amax_j, every other weight rounds on a grid finer by 1/r.

r is chosen per row (of qkv, dense, fc and gate: CLIPPED_LINEARS) from GRID to minimise the
GEMM's output error on the calibration set with diagonal activation statistics,

    err_j(r) = sum_c E[x_c^2] (w_jc - Q_r(w)_jc)^2,

E[x_c^2] the calibrated mean square of input channel c (trt_builder/calibrate/stats.py). Q_r is
the builder's arithmetic on the row as it is written: clamped to a bound that is itself a value
of the checkpoint dtype (so that the written row's max, and with it the builder's scale, is
exactly the one evaluated), cast, then `weight_only_int8`. r = 1 is plain rounding and is in
GRID, so no row is worse on that measure; the checkpoint stays float and portable.

Written by hand: modelopt's and AWQ's clip searches choose ranges for their own quantizers
(their scales and rounding, int4 groups), not for the one trtllm-build applies at load time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtimes.checkpoint import weight_only_int8

#: The linears clipped: those trtllm-build quantizes (runtimes/checkpoint.py
#: WEIGHT_ONLY_LINEARS) but proj. On SmolLM2, clipping proj lowers its output error too, yet
#: raises held-out perplexity by 0.2-0.4 point in each of four rounding draws (its shrunken
#: outliers add up along the residual stream); clipping the other four does not
#: (benchmarks/int8_wo.py, docs/benchmarks.md).
CLIPPED_LINEARS = ("qkv.weight", "dense.weight", "fc.weight", "gate.weight")
#: Clipping ratios tried, 1.00 down to 0.80; 1.00 first, so that ties keep plain rounding.
GRID = tuple(1.0 - i / 200 for i in range(41))
ROWS_PER_BLOCK = 256  # bounds the temporaries of the search on large matrices


def record() -> dict[str, object]:
    """What a clipped checkpoint says of its weights (config.json `producer.weight_clipping`),
    so that verify checks them by this rule, not against the model's weights as they are."""
    return {
        "linears": list(CLIPPED_LINEARS),
        "ratios": list(GRID),
        "rule": "each row of these decoder linears is the model's row clamped to +-(r * its "
        "absmax), the bound rounded to the checkpoint dtype, r one of the ratios; row-parallel "
        "linears per tensor-parallel column slice",
    }


@dataclass
class ClipTally:
    """What the clipping did over a checkpoint: rows searched, rows clipped, sum of ratios."""

    rows: int = 0
    clipped: int = 0
    ratio_sum: float = 0.0

    def add(self, ratios: torch.Tensor) -> None:
        self.rows += ratios.numel()
        self.clipped += int((ratios < 1.0).sum())
        self.ratio_sum += float(ratios.double().sum())

    def summary(self) -> dict[str, float | int]:
        mean = self.ratio_sum / self.rows if self.rows else 1.0
        return {"rows": self.rows, "clipped": self.clipped, "mean_ratio": round(mean, 5)}


def clamp_rows(
    w: torch.Tensor,
    ratios: torch.Tensor | float,
    dtype: torch.dtype,
    amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 `w` [out, in] with row j clamped to +-ratios[j] * its absmax (`amax`, [out, 1]),
    the bound rounded to `dtype` first: cast to `dtype`, the clamped entries are the bound."""
    amax = w.abs().amax(dim=1, keepdim=True) if amax is None else amax
    if isinstance(ratios, torch.Tensor):
        ratios = ratios.reshape(-1, 1)
    bound = (amax * ratios).to(dtype).float()
    return torch.minimum(torch.maximum(w, -bound), bound)


def output_error(
    w: torch.Tensor, written: torch.Tensor, sqmean: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """err_j per row: the error of what the builder makes of `written`, weighted by E[x_c^2]."""
    diff = w - weight_only_int8(written.to(dtype), dtype)
    return diff.square() @ sqmean


def search_ratios(w: torch.Tensor, sqmean: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ratio in GRID with the least output error, per row of float32 `w` [out, in]."""
    amax = w.abs().amax(dim=1, keepdim=True)
    best_err = torch.full((w.shape[0],), float("inf"), device=w.device)
    best = torch.ones(w.shape[0], device=w.device)
    for r in GRID:
        err = output_error(w, clamp_rows(w, r, dtype, amax), sqmean, dtype)
        better = err < best_err  # strictly: a tie keeps the larger ratio
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, r, best)
    return best


def clip_weight(
    weight: torch.Tensor, sqmean: torch.Tensor, dtype: torch.dtype, tally: ClipTally | None = None
) -> torch.Tensor:
    """`weight` [out, in] as float32 with every row clamped at its best ratio (`sqmean`: the
    mean square of each input channel); the ratios go into `tally`."""
    w, sq = weight.float(), sqmean.float().to(weight.device)
    blocks = []
    for block in w.split(ROWS_PER_BLOCK):
        ratios = search_ratios(block, sq, dtype)
        if tally is not None:
            tally.add(ratios)
        blocks.append(clamp_rows(block, ratios, dtype))
    return torch.cat(blocks)
