"""Verify gates and the fixed prompt set (light: no torch import, so cached reruns stay fast)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..core.errors import InputError


@dataclass(frozen=True)
class Gate:
    """Pass criteria against the reference: teacher-forced top-1 agreement and mean
    KL(reference || candidate) on the prompt set, the held-out perplexity increase (percent),
    and optionally greedy agreement."""

    min_top1: float
    max_kl: float
    max_ppl_delta_pct: float | None = None
    min_greedy: float | None = None


#: Default gates per mode, against a float32 transformers reference. Measured on
#: SmolLM2-135M-Instruct (docs/benchmarks.md) with headroom for other models.
DEFAULT_GATES: dict[str, Gate] = {
    "float32": Gate(min_top1=0.999, max_kl=1e-4, max_ppl_delta_pct=0.01),
    "float16": Gate(min_top1=0.99, max_kl=1e-3, max_ppl_delta_pct=0.1),
    "bfloat16": Gate(min_top1=0.95, max_kl=1e-2, max_ppl_delta_pct=1.0),
    "int8-wo": Gate(min_top1=0.95, max_kl=2e-2, max_ppl_delta_pct=2.0),
    # SmoothQuant W8A8 with per-token activation scales (with or without the INT8 KV cache)
    "int8": Gate(min_top1=0.85, max_kl=6e-2, max_ppl_delta_pct=3.0),
    # ... with one static activation scale per tensor (--sq-granularity per-tensor): a coarser
    # format; SmolLM2 with searched alphas: top-1 0.82, KL 0.12, perplexity +3.8%
    "int8-static": Gate(min_top1=0.75, max_kl=0.2, max_ppl_delta_pct=6.0),
    # FP8 per-tensor W8A8 with calibrated amax scales
    "fp8": Gate(min_top1=0.85, max_kl=0.1, max_ppl_delta_pct=5.0),
}


#: What the INT8 KV cache may add to a mode's held-out perplexity gate, in points: verify
#: decodes an INT8-KV-cache checkpoint's held-out text through the cache, where its rounding
#: shows (docs/verify.md), and the cache is to cost at most this over the same build without it.
KV_INT8_PPL_POINTS = 0.5
#: The same for the FP8 KV cache (e4m3 keeps 3 mantissa bits: a coarser cache than INT8's
#: balanced one on the default model, docs/benchmarks.md).
KV_FP8_PPL_POINTS = 1.5


def gate_key(mode: str) -> str:
    """The DEFAULT_GATES key of a mode name (int8-sq and int8-sq-kv8 share int8's, the static
    int8-sq-static* int8-static's; int8-wo-noclip int8-wo's; float16-kv8 and float16-fp8kv
    float16's, fp8-fp8kv fp8's)."""
    if mode.startswith("fp8"):
        return "fp8"
    if mode.startswith("int8-sq-static"):
        return "int8-static"
    if mode.startswith("int8-sq"):
        return "int8"
    return (
        "int8-wo"
        if mode.startswith("int8-wo")
        else mode.removesuffix("-kv8").removesuffix("-fp8kv")
    )


def gate_for(
    mode: str,
    *,
    min_top1: float | None = None,
    max_kl: float | None = None,
    max_ppl_delta_pct: float | None = None,
    min_greedy: float | None = None,
) -> Gate:
    """The default gate of a mode, with the spec's overrides (None keeps the default)."""
    default = DEFAULT_GATES[gate_key(mode)]
    points = {"-kv8": KV_INT8_PPL_POINTS, "-fp8kv": KV_FP8_PPL_POINTS}
    for suffix, extra in points.items():
        if mode.endswith(suffix) and default.max_ppl_delta_pct is not None:
            default = replace(default, max_ppl_delta_pct=default.max_ppl_delta_pct + extra)
    return Gate(
        min_top1=default.min_top1 if min_top1 is None else min_top1,
        max_kl=default.max_kl if max_kl is None else max_kl,
        max_ppl_delta_pct=default.max_ppl_delta_pct
        if max_ppl_delta_pct is None
        else max_ppl_delta_pct,
        min_greedy=default.min_greedy if min_greedy is None else min_greedy,
    )


def hf_quantization(directory: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The quantization a loader reads from a Hugging Face checkpoint (`config`: its
    config.json): hf_quant_config.json (TensorRT-LLM's first choice), else config.json's
    modelopt `quantization_config`, else none. Keys: quant_algo, kv_cache_quant_algo,
    exclude_modules (docs/llmapi.md)."""
    path = directory / "hf_quant_config.json"
    if path.is_file():
        try:
            found = json.loads(path.read_text()).get("quantization") or {}
        except (OSError, ValueError, AttributeError):
            raise InputError(f"{path} is not a JSON table: rewrite it or reconvert") from None
        return {k: found.get(k) for k in ("quant_algo", "kv_cache_quant_algo", "exclude_modules")}
    found = config.get("quantization_config") or {}
    if found and found.get("quant_method") != "modelopt":
        raise InputError(
            f"{directory}: quantization_config method {found.get('quant_method')!r} is not "
            "read here (modelopt's unified format is): pass a checkpoint trt-builder wrote"
        )
    return modelopt_quantization(found)


def modelopt_quantization(found: dict[str, Any]) -> dict[str, Any]:
    """The quantization of config.json's modelopt `quantization_config` (`found`), in
    hf_quant_config.json's keys."""
    return {
        "quant_algo": found.get("quant_algo"),
        "kv_cache_quant_algo": "FP8" if found.get("kv_cache_scheme") else None,
        "exclude_modules": found.get("ignore"),
    }


def checkpoint_mode(checkpoint: Path) -> str:
    """The mode name of a checkpoint directory (TensorRT-LLM's, or the Hugging Face one of the
    llmapi target): a DEFAULT_GATES key, with "-kv8" for the INT8 KV cache and "-fp8kv" for
    the FP8 one."""
    try:
        config = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError):
        raise InputError(
            f"{checkpoint} has no readable config.json: pass a TensorRT-LLM checkpoint directory"
        ) from None
    if "architecture" not in config and "architectures" in config:  # a Hugging Face checkpoint
        quant = hf_quantization(checkpoint, config)
        dtype = config.get("dtype") or config.get("torch_dtype")
    else:
        quant, dtype = config.get("quantization") or {}, config.get("dtype")
    algo = quant.get("quant_algo")
    kv8 = {"INT8": "-kv8", "FP8": "-fp8kv"}.get(str(quant.get("kv_cache_quant_algo")), "")
    if algo == "FP8":
        return "fp8" + kv8
    if algo == "W8A16":
        return "int8-wo" + kv8
    if str(algo).startswith("W8A8_SQ_"):
        return ("int8" if "PER_TOKEN" in str(algo) else "int8-static") + kv8
    if algo is None and dtype in DEFAULT_GATES:
        return str(dtype) + kv8
    raise InputError(f"no verify gate for a {dtype} / {algo} checkpoint yet")
