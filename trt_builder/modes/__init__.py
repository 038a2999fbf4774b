"""The quantization modes, one room each (a module of this package: a frozen config and
everything the mode decides), the KV cache's room (kvcache.py), and the registry the rest of
trt-builder asks: which --dtype values exist, which mode a checkpoint holds, a mode's gate.
Adding a mode is a new room and one line in ROOMS (docs/adding-a-mode.md)."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

from ..core.errors import InputError, SpecError
from ..spec.gates import Gate
from ..spec.gpus import FEATURES
from .base import Mode, ModeOptions, WeightStorage
from .floats.spec import FLOAT_DTYPES, FloatMode
from .fp8.spec import Fp8
from .int4_awq.spec import Int4Awq, check_group_size
from .kvcache.spec import (
    KV_CACHE_CHOICES,
    KV_DOCTOR,
    KV_PPL_PCT,
    KV_SUFFIX,
    check_kv,
    kv_cache_of,
)
from .nvfp4.spec import Nvfp4
from .quantization import checkpoint_quantization
from .smoothquant.spec import GRANULARITIES, SmoothQuant, check_alpha
from .w4a8_awq.spec import W4a8Awq
from .weight_only.spec import WeightOnlyInt8

#: The rooms, in the order --dtype lists their choices.
ROOMS: tuple[type[Mode], ...] = (FloatMode, SmoothQuant, WeightOnlyInt8, Fp8, Int4Awq, W4a8Awq,
                                 Nvfp4)  # fmt: skip
QuantMode = Mode

DTYPE_CHOICES = tuple(choice for room in ROOMS for choice in room.CHOICES)
#: --dtype's help, from the rooms' words.
DTYPE_HELP = "Precision: " + ", ".join(w for room in ROOMS for w in room.CHOICES.values()) + "."
#: Default gates per gate key, against a float32 transformers reference.
DEFAULT_GATES: dict[str, Gate] = {key: gate for room in ROOMS for key, gate in room.GATES.items()}
#: `trt-builder doctor`'s rows: row name -> the GPU features it needs; the rooms' rows and the
#: KV caches', in the order of the GPU features they need (spec/gpus.py: FEATURES).
DOCTOR_ROWS: dict[str, tuple[str, ...]] = dict(sorted(
    [*((row, needs) for room in ROOMS for row, needs in room.DOCTOR.items()), *KV_DOCTOR.items()],
    key=lambda row: max((list(FEATURES).index(f) for f in row[1]), default=0),
))  # fmt: skip

__all__ = [
    "DEFAULT_GATES", "DOCTOR_ROWS", "DTYPE_CHOICES", "DTYPE_HELP", "FLOAT_DTYPES",
    "GRANULARITIES", "KV_CACHE_CHOICES", "KV_PPL_PCT", "KV_SUFFIX", "ROOMS", "Fp8",
    "FloatMode", "Int4Awq", "Mode", "Nvfp4", "ModeOptions", "QuantMode", "SmoothQuant", "W4a8Awq",
    "WeightOnlyInt8",
    "WeightStorage", "check_alpha", "check_group_size", "checkpoint_mode", "gate_for", "mode_for", "mode_of",
    "quant_algos_loaded_by",
]  # fmt: skip


def mode_for(dtype: str, *, kv_cache: str = "model", options: ModeOptions | None = None) -> Mode:
    """The mode of a `--dtype` value, with its KV cache and the options sections' choices."""
    check_kv(kv_cache)
    for room in ROOMS:
        if dtype in room.CHOICES:
            return room.choose(dtype, kv_cache, options or ModeOptions())
    raise SpecError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_CHOICES)}")


@cache
def _names() -> dict[str, tuple[str, str]]:
    """Every mode name, and every checkpoint mode (a gate key with its KV suffix), to its gate
    key and KV cache."""
    found = {}
    for room in ROOMS:
        for mode in room.variants():
            found[mode.name] = (mode.gate_key, mode.kv_cache)
            found[mode.gate_key + KV_SUFFIX[mode.kv_cache]] = (mode.gate_key, mode.kv_cache)
    return found


def gate_for(
    mode: str,
    *,
    min_top1: float | None = None,
    max_kl: float | None = None,
    max_ppl_delta_pct: float | None = None,
    min_greedy: float | None = None,
) -> Gate:
    """The default gate of a mode (a mode name, or a checkpoint's: checkpoint_mode), with the
    spec's overrides (None keeps the default); a quantized KV cache may raise the held-out
    perplexity the gate allows by its share of it (kvcache/spec.py: KV_PPL_PCT)."""
    key, kv = _names().get(mode, (mode, "model"))
    default = DEFAULT_GATES[key]
    if kv in KV_PPL_PCT and default.max_ppl_delta_pct is not None:
        allowed = (1 + default.max_ppl_delta_pct / 100) * (1 + KV_PPL_PCT[kv] / 100)
        default = replace(default, max_ppl_delta_pct=round(100 * (allowed - 1), 6))
    return Gate(
        min_top1=default.min_top1 if min_top1 is None else min_top1,
        max_kl=default.max_kl if max_kl is None else max_kl,
        max_ppl_delta_pct=default.max_ppl_delta_pct
        if max_ppl_delta_pct is None
        else max_ppl_delta_pct,
        min_greedy=default.min_greedy if min_greedy is None else min_greedy,
    )


def mode_of(quantization: dict[str, Any], dtype: str) -> Mode:
    """The mode a checkpoint holds, from its quantization table (TensorRT-LLM's config.json
    `quantization`, or hf_quant_config.json's) and its dtype; each room recognises its own
    (Mode.of_checkpoint). InputError for one no room writes."""
    algo = quantization.get("quant_algo")
    kv_cache = kv_cache_of(quantization.get("kv_cache_quant_algo"))
    for room in ROOMS:
        try:
            mode = room.of_checkpoint(algo, kv_cache, dtype)
        except SpecError as exc:  # a combination trt-builder does not write
            raise InputError(f"a {dtype} / {algo} checkpoint is not read here: {exc}") from None
        if mode is not None:
            return mode
    raise InputError(f"no verify gate for a {dtype} / {algo} checkpoint yet")


def quant_algos_loaded_by(loader: str) -> tuple[str, ...]:
    """The quant_algo values the llmapi target's `loader` runs: those of the modes whose rooms
    name it (Mode.LOADED_BY)."""
    return tuple(sorted({mode.quant_algo for room in ROOMS if loader in room.LOADED_BY
                         for mode in room.variants() if mode.quant_algo}))  # fmt: skip


def checkpoint_mode(checkpoint: Path) -> str:
    """The mode of a checkpoint directory (TensorRT-LLM's, or the Hugging Face one of the
    llmapi target), as verify names it: its gate key, with "-kv8" for the INT8 KV cache and
    "-fp8kv" for the FP8 one."""
    mode = mode_of(*checkpoint_quantization(checkpoint))
    return mode.gate_key + KV_SUFFIX[mode.kv_cache]
