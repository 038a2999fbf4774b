"""INT4 AWQ's recipe: each GEMM group's AWQ exponent and its INT4 rounding, chosen by measured
accuracy (search.py, with GPTQ's update at the group scales in rounding.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ....recipe.dispatch import run_search
from ..spec import Int4SearchSet


@run_search.register(Int4SearchSet)
def _int4(
    choice: Int4SearchSet, hf: Path, calibration: Path, work: Path, where: dict[str, Any]
) -> tuple[dict[str, Any], tuple[str, ...]]:
    from safetensors.torch import save_file

    from .search import WEIGHTS, search_int4

    recipe, tensors = search_int4(hf, calibration, choice, **where)
    if tensors:
        save_file(tensors, str(work / WEIGHTS), metadata={"format": "pt"})
        os.chmod(work / WEIGHTS, 0o644)  # safetensors makes it 0600
    return recipe, ()
