"""W4A8 AWQ (`quant_algo: W4A8_AWQ`) in TensorRT-LLM's checkpoint format: INT4 AWQ's converter
(modes/int4_awq/convert.py: the INT4 values, group scales and pre-quantization scales the recipe
chose), which for a mode with FP8 inputs adds each linear's `weights_scaling_factor_2` (the
weight's FP8 stage) and `activation_scaling_factor` (the input's, from the calibrated absmax
times the pre-quantization scale): checkpoint/w4a8.py. The model it reads is the padded twin
where the mode needed one (source/twin.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...convert.dispatch import register
from ..int4_awq.convert import convert_int4_awq
from .spec import W4a8Awq


@register(W4a8Awq)
def _w4a8_awq(mode: W4a8Awq, hf_dir: Path, out_dir: Path, *, tp: int, pp: int,
              calibration: Path | None, recipe: Path | None = None,
              remember: Callable[[Path, str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    assert calibration is not None  # AWQ's scales and the inputs' FP8 scale
    return convert_int4_awq(
        hf_dir, out_dir, mode, calibration, tp=tp, pp=pp, recipe=recipe, remember=remember
    )
