"""NVFP4's recipe: each weight's e2m1 rounding at the block scales, error-compensated or to
nearest, chosen by measured accuracy (search.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ....recipe.dispatch import run_search
from ..spec import Nvfp4SearchSet


@run_search.register(Nvfp4SearchSet)
def _nvfp4(
    choice: Nvfp4SearchSet, hf: Path, calibration: Path, work: Path, where: dict[str, Any]
) -> tuple[dict[str, Any], tuple[str, ...]]:
    from safetensors.torch import save_file

    from .search import WEIGHTS, search_nvfp4

    recipe, tensors = search_nvfp4(hf, calibration, choice, **where)
    if tensors:
        save_file(tensors, str(work / WEIGHTS), metadata={"format": "pt"})
        os.chmod(work / WEIGHTS, 0o644)  # safetensors makes it 0600
    return recipe, ()
