"""Where the rooms register what convert does for them: each mode's room its converter
(convert/model.py convert_model finds them: `@register(ItsConfig)` on a function of
convert_model's signature), each target's room the checkpoint it deploys (checkpoint_writer)."""

from __future__ import annotations

from collections.abc import Callable
from functools import singledispatch
from pathlib import Path
from typing import Any

from ..modes import QuantMode
from ..targets import Target


@singledispatch
def converter(
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
    raise TypeError(f"internal: no converter for {type(mode).__name__}")


register = converter.register


@singledispatch
def checkpoint_writer(
    target: Target,
    mode: QuantMode,
    hf_dir: Path,
    out_dir: Path,
    *,
    tp: int,
    pp: int,
    calibration: Path | None,
    recipe: Path | None,
    remember: Callable[[Path, str], None] | None,
) -> dict[str, Any]:
    """Write the checkpoint `target` deploys (each target's room registers its own, in its
    convert.py); the summary. The arguments are convert_model's."""
    raise TypeError(f"internal: no checkpoint writer for {type(target).__name__}")
