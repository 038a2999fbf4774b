"""What the recipe search tries and scores on, and where its recipe goes. No torch: the stage's
key is computed from it on every run, cached ones included; and convert imports this module
alone of the recipe's, so that editing the search does not change convert's key."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..core.stage import BuildContext
from ..spec.modes import SmoothQuant

#: Global alphas tried.
ALPHAS = (0.4, 0.5, 0.6, 0.7, 0.8)
#: Alphas tried per layer and GEMM group. 0.9 was dropped: groups that chose it fitted their
#: GEMM better but lost on the search split.
GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


@dataclass(frozen=True)
class SearchSet:
    """What the search tries and scores on: its cache key (with the calibration and the model).
    `batch` and `device` change how it runs, not what it finds."""

    per_token: bool = True
    alphas: tuple[float, ...] = ALPHAS
    grid: tuple[float, ...] = GRID
    tokens: int = 4096
    fit_tokens: int = 1024

    def key_fields(self) -> dict[str, Any]:
        return asdict(self)


def searches(ctx: BuildContext) -> bool:
    """Whether the mode leaves SmoothQuant's alpha to the search."""
    mode = ctx.spec.mode
    return isinstance(mode, SmoothQuant) and mode.alpha is None


def recipe_dir(ctx: BuildContext) -> Path:
    granularity = "per-token" if getattr(ctx.spec.mode, "per_token", True) else "per-tensor"
    return ctx.layout.recipe(f"{ctx.spec.calibrate.slug()}-{granularity}")
