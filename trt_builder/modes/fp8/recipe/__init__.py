"""FP8's recipe: each weight's e4m3 rounding, error-compensated or to nearest, chosen by
measured accuracy (search.py, with GPTQ's column update in rounding.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ....recipe.dispatch import run_search
from ..spec import Fp8SearchSet


@run_search.register(Fp8SearchSet)
def _fp8(
    choice: Fp8SearchSet, hf: Path, calibration: Path, work: Path, where: dict[str, Any]
) -> tuple[dict[str, Any], tuple[str, ...]]:
    from safetensors.torch import save_file

    from .search import WEIGHTS, search_fp8

    recipe, tensors = search_fp8(hf, calibration, choice, **where)
    if tensors:
        save_file(tensors, str(work / WEIGHTS), metadata={"format": "pt"})
        os.chmod(work / WEIGHTS, 0o644)  # safetensors makes it 0600
    return recipe, ()
