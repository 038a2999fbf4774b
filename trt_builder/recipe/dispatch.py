"""Where each mode's room registers its recipe search (the recipe stage runs it), keyed by the
type of its search set (Mode.recipe_set)."""

from __future__ import annotations

from functools import singledispatch
from pathlib import Path
from typing import Any

from ..modes.base import RecipeSet


@singledispatch
def run_search(
    choice: RecipeSet, hf: Path, calibration: Path, work: Path, where: dict[str, Any]
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Run the search `choice` belongs to (each mode's room registers its own, in its
    recipe/): its recipe.json, and the keys of it the stage's summary adds. What else it
    writes goes into `work`; `where`: device, batch, offload, progress."""
    raise TypeError(f"internal: no recipe search for {type(choice).__name__}")
