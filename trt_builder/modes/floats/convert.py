"""The float modes' converter: convert/floats.py's stream, in the model dtype (with the INT8 or
FP8 KV cache's scales where one is chosen)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...convert.dispatch import register
from ...convert.floats import convert_checkpoint
from .spec import FloatMode


@register(FloatMode)
def _float(mode: FloatMode, hf_dir: Path, out_dir: Path, *, tp: int, pp: int,
           calibration: Path | None, recipe: Path | None = None,
           remember: Callable[[Path, str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    calibration = calibration if mode.needs_calibration else None
    return convert_checkpoint(hf_dir, out_dir, mode, tp=tp, pp=pp, calibration=calibration,
                              remember=remember)  # fmt: skip
