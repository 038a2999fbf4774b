"""The engine target's checkpoint: TensorRT-LLM's, at the spec's TP and PP (the mode's
converter, convert/model.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...convert.dispatch import checkpoint_writer
from ...convert.model import convert_model
from ...modes import QuantMode
from .spec import EngineTarget


@checkpoint_writer.register(EngineTarget)
def _engine(target: EngineTarget, mode: QuantMode, hf_dir: Path, out_dir: Path, *, tp: int,
            pp: int, calibration: Path | None, recipe: Path | None,
            remember: Callable[[Path, str], None] | None) -> dict[str, Any]:  # fmt: skip
    return convert_model(mode, hf_dir, out_dir, tp=tp, pp=pp, calibration=calibration,
                         recipe=recipe, remember=remember)  # fmt: skip
