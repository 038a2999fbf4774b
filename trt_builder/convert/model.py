"""The converter of each quantization mode, chosen by the mode's type: each mode's room
registers its own (`trt_builder/modes/<mode>/convert.py`: the float and INT8 weight-only modes
through convert/floats.py, SmoothQuant with the recipe stage's alphas when alpha is "auto",
FP8), and the stage finds them with load_rooms("modes", "convert")."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.rooms import load_rooms
from ..modes import QuantMode
from .dispatch import converter


def convert_model(
    mode: QuantMode,
    hf_dir: Path,
    out_dir: Path,
    *,
    tp: int,
    pp: int,
    calibration: Path | None,
    recipe: Path | None = None,
    remember: Callable[[Path, str], None] | None = None,
) -> dict[str, Any]:
    """Convert `hf_dir` into a TensorRT-LLM checkpoint in `out_dir` in `mode`; the summary.
    `calibration`: the statistics directory, for the modes that need one; `recipe`: the
    recipe stage's recipe.json, for SmoothQuant with alpha "auto" and searched FP8; `remember`: given each
    rank file's sha256, hashed as it was written (DigestCache.remember)."""
    load_rooms("modes", "convert")
    return converter(mode, hf_dir, out_dir, tp=tp, pp=pp, calibration=calibration,
                     recipe=recipe, remember=remember)  # fmt: skip
