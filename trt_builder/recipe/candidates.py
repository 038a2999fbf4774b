"""Where the recipe stage's output goes and what convert reads of it, asked of the mode (what
its search tries: Mode.recipe_set, in its room). No torch: the stage's key is computed from it
on every run, cached ones included; and convert imports this module alone of the recipe's, so
that editing a search does not change convert's key."""

from __future__ import annotations

from pathlib import Path

from ..core.stage import BuildContext
from ..modes import Mode
from ..modes.base import RecipeSet
from ..source.twin import calibration_dir


def search_set(mode: Mode) -> RecipeSet | None:
    """What the recipe stage searches for this mode, or None where it does not run."""
    return mode.recipe_set() if mode.searches else None


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
    """The recipe's directory: after the calibration's, the search set's (a mode with none
    asked for the recipe stage by name: "none")."""
    choice = ctx.spec.mode.recipe_set()
    return ctx.layout.recipe(f"{calibration_dir(ctx).name}-{choice.slug() if choice else 'none'}")
