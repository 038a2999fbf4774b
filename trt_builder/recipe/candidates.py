"""What the recipe searches try and score on (SmoothQuant's alphas; FP8's weight rounding), and
where their recipe goes. No torch: the stage's
key is computed from it on every run, cached ones included; and convert imports this module
alone of the recipe's, so that editing the search does not change convert's key."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..core.stage import BuildContext
from ..spec.modes import Fp8, Mode, SmoothQuant

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

    def slug(self) -> str:
        """Its recipe directory's name, after the calibration's."""
        return "per-token" if self.per_token else "per-tensor"

    def read_by_convert(self, directory: Path) -> Path:
        """What convert reads of its recipe `directory`: recipe.json (the chosen alphas)."""
        return directory / "recipe.json"


@dataclass(frozen=True)
class Fp8SearchSet:
    """What the FP8 search tries and scores on (recipe/fp8.py): its cache key, with the
    calibration and the model. The weights are rounded to `dtype` before FP8, as convert
    rounds them. `fit_tokens` give each GEMM's input Hessian and the next `tokens` score the
    candidates, each half prose of the search split and half text the model samples itself;
    `seed` shuffles the split's documents (0: as bundled) and seeds the sampling."""

    dtype: str = "float16"
    tokens: int = 4096
    fit_tokens: int = 6144
    damp: float = 0.01  # GPTQ's dampening: a fraction of the Hessian's mean diagonal
    block: int = 128  # columns updated together (GPTQ's lazy batch)
    seed: int = 0

    def key_fields(self) -> dict[str, Any]:
        return {"mode": "fp8", **asdict(self)}

    def slug(self) -> str:
        """Its recipe directory's name, after the calibration's (the rounded weights depend on
        the dtype)."""
        return f"fp8-{self.dtype}"

    def read_by_convert(self, directory: Path) -> Path:
        """What convert reads of its recipe `directory`: recipe.json and the weights beside it."""
        return directory


#: The recipe search of each mode that has one, by its config's type (Mode.searches says
#: whether a config leaves a choice to it).
SEARCHES: dict[type[Mode], Callable[[Any], SearchSet | Fp8SearchSet]] = {
    SmoothQuant: lambda mode: SearchSet(per_token=mode.per_token),
    Fp8: lambda mode: Fp8SearchSet(dtype=mode.dtype),
}


def _set_of(mode: Mode) -> SearchSet | Fp8SearchSet | None:
    make = SEARCHES.get(type(mode))
    return None if make is None else make(mode)


def search_set(mode: Mode) -> SearchSet | Fp8SearchSet | None:
    """What the recipe stage searches for this mode, or None where it does not run."""
    return _set_of(mode) if mode.searches else None


def searches(ctx: BuildContext) -> bool:
    """Whether the mode leaves a choice to the recipe stage (SmoothQuant's alpha "auto", FP8's
    searched rounding)."""
    return search_set(ctx.spec.mode) is not None


def recipe_input(ctx: BuildContext) -> Path | None:
    """What convert reads of the recipe stage's output, or None where the mode searches
    nothing."""
    choice = search_set(ctx.spec.mode)
    return None if choice is None else choice.read_by_convert(recipe_dir(ctx))


def recipe_dir(ctx: BuildContext) -> Path:
    choice = _set_of(ctx.spec.mode) or SearchSet()
    return ctx.layout.recipe(f"{ctx.spec.calibrate.slug()}-{choice.slug()}")
