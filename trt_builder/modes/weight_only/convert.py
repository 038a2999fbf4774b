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

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...calibrate.stats import load_stats
from ...checkpoint.parallel import tp_kind
from ...convert.dispatch import register
from ...convert.floats import Rewrite, Transform, convert_checkpoint, then
from ...core.errors import ConversionError
from ...models.family import TensorRule
from ...runtimes.checkpoint import weight_only_int8
from .spec import WeightOnlyInt8

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


@dataclass
class Clipping:
    """INT8 weight-only clipping as convert/floats.py's WeightRewrite, weighted by the
    calibration's statistics (`stats`)."""

    stats: dict[str, torch.Tensor]
    tally: ClipTally = field(default_factory=lambda: ClipTally())

    def rewrite(
        self,
        rules: list[TensorRule],
        rewrite: Rewrite,
        inputs: dict[str, torch.Tensor],
        dtype: torch.dtype,
        tp: int,
    ) -> Rewrite:
        return _clipping(rules, self.stats, rewrite, inputs, dtype, tp, self.tally)

    def producer(self) -> dict[str, Any] | None:
        return {"weight_clipping": record()} if self.tally.rows else None

    def summary(self) -> dict[str, Any]:
        return {"weight_clipping": self.tally.summary()} if self.tally.rows else {}


@register(WeightOnlyInt8)
def _weight_only(mode: WeightOnlyInt8, hf_dir: Path, out_dir: Path, *, tp: int, pp: int,
                 calibration: Path | None, recipe: Path | None = None,
                 remember: Callable[[Path, str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """convert/floats.py's stream, the weights clipped where the mode clips (the builder
    quantizes them: W8A16 checkpoints are float)."""
    calibration = calibration if mode.needs_calibration else None
    clipping = Clipping(load_stats(calibration)) if mode.clips and calibration else None
    return convert_checkpoint(hf_dir, out_dir, mode, tp=tp, pp=pp, calibration=calibration,
                              remember=remember, weights=clipping)  # fmt: skip


def _clipping(
    rules: list[TensorRule],
    stats: dict[str, torch.Tensor],
    rewrite: Rewrite,
    inputs: dict[str, torch.Tensor],
    dtype: torch.dtype,
    tp: int,
    tally: ClipTally,
) -> Rewrite:
    """`rewrite` with INT8 weight-only clipping after it on every clipped linear (the builder
    quantizes the final weights). `inputs`: factors their input channels come multiplied by
    (W' = W / f, x' = x f: E[x'^2] = E[x^2] f^2)."""
    out = dict(rewrite)
    for rule in rules:
        if not (
            rule.name.startswith("transformer.layers.") and rule.name.endswith(CLIPPED_LINEARS)
        ):
            continue
        module = rule.sources[0].removesuffix(".weight")  # q/k/v and gate/up share one input
        if f"{module}.input_sqmean" not in stats:
            raise ConversionError(
                f"the calibration has no input_sqmean for {module}: recalibrate this model "
                "(trt-builder calibrate --force)"
            )
        sqmean = stats[f"{module}.input_sqmean"].float()
        if rule.name in inputs:
            sqmean = sqmean * inputs[rule.name].float().square()
        # row-parallel ranks each quantize their slice of the columns: one search per slice
        slices = tp if tp_kind(rule.name) == "row" else 1
        out[rule.name] = then(rewrite.get(rule.name), _clip(sqmean, dtype, slices, tally))
    return out


def _clip(sqmean: torch.Tensor, dtype: torch.dtype, slices: int, tally: ClipTally) -> Transform:
    """Clip the rows of each part (q, k, v), each of its `slices` column slices on its own."""

    def one(part: torch.Tensor) -> torch.Tensor:
        pieces = zip(part.chunk(slices, 1), sqmean.chunk(slices), strict=True)
        return torch.cat([clip_weight(w, s, dtype, tally) for w, s in pieces], 1)

    return lambda parts: [one(part) for part in parts]
