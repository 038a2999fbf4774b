"""SmoothQuant's recipe: the alphas of alpha "auto", per layer and GEMM group, chosen by
measured accuracy (search.py), each candidate simulated in memory (simulate.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ....recipe.dispatch import run_search
from ..spec import SearchSet


@run_search.register(SearchSet)
def _alphas(
    choice: SearchSet, hf: Path, calibration: Path, work: Path, where: dict[str, Any]
) -> tuple[dict[str, Any], tuple[str, ...]]:
    from .search import search

    where = {k: v for k, v in where.items() if k != "records"}  # it samples no text to keep
    return search(hf, calibration, choice, **where), ("alpha",)
