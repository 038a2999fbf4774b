"""The converter of each quantization mode, chosen by the mode's type: the float and INT8
weight-only modes (floats.py, with the INT8 KV cache's balancing), SmoothQuant
(smoothquant.py, with the recipe stage's alphas when alpha is "auto") and FP8 (fp8.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from functools import singledispatch
from pathlib import Path
from typing import Any

from ..core.errors import ConversionError
from ..core.fsio import write_json
from ..spec.modes import FloatMode, Fp8, QuantMode, SmoothQuant, WeightOnlyInt8
from .floats import convert_checkpoint
from .fp8 import convert_fp8
from .smoothquant import convert_smoothquant


@singledispatch
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
    raise TypeError(f"internal: no converter for {type(mode).__name__}")


@convert_model.register(FloatMode)
@convert_model.register(WeightOnlyInt8)
def _float(mode: FloatMode | WeightOnlyInt8, hf_dir: Path, out_dir: Path, *, tp: int, pp: int,
           calibration: Path | None, recipe: Path | None = None,
           remember: Callable[[Path, str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    calibration = calibration if mode.needs_calibration else None
    return convert_checkpoint(hf_dir, out_dir, mode, tp=tp, pp=pp, calibration=calibration,
                              remember=remember)  # fmt: skip


@convert_model.register(SmoothQuant)
def _smoothquant(mode: SmoothQuant, hf_dir: Path, out_dir: Path, *, tp: int, pp: int,
                 calibration: Path | None, recipe: Path | None = None,
                 remember: Callable[[Path, str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    assert calibration is not None  # SmoothQuant always calibrates
    found, per_layer = None, None
    if mode.alpha is None:  # the recipe stage chose them
        if recipe is None or not recipe.is_file():
            raise ConversionError("SmoothQuant alpha auto needs the recipe: run trt-builder recipe")
        found = json.loads(recipe.read_text())
        per_layer = {int(k): v for k, v in found["alphas"].items()}
        mode = replace(mode, alpha=float(found["alpha"]))
    summary = convert_smoothquant(hf_dir, out_dir, mode, calibration, tp=tp, pp=pp,
                                  alphas=per_layer, remember=remember)  # fmt: skip
    if found is not None:
        write_json(out_dir / "recipe.json", found)  # trtllm-build reads only its own files
        summary["recipe"] = {k: found[k] for k in ("chosen", "alpha", "tokens", "device")}
    return summary


@convert_model.register(Fp8)
def _fp8(mode: Fp8, hf_dir: Path, out_dir: Path, *, tp: int, pp: int,
         calibration: Path | None, recipe: Path | None = None,
         remember: Callable[[Path, str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    assert calibration is not None  # FP8 always calibrates: the activation scales
    return convert_fp8(hf_dir, out_dir, mode, calibration, tp=tp, pp=pp, recipe=recipe,
                       remember=remember)  # fmt: skip
