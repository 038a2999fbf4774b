"""The quantization a checkpoint declares (light: no torch import, so cached reruns stay fast):
TensorRT-LLM's config.json `quantization`, or the Hugging Face checkpoint's of the llmapi
target, in one set of keys (quant_algo, kv_cache_quant_algo, exclude_modules) that the rooms
recognise (modes/__init__.py: mode_of)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..core.errors import InputError
from .kvcache.spec import kv_quant_algo_of_scheme


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
        "kv_cache_quant_algo": kv_quant_algo_of_scheme(found.get("kv_cache_scheme")),
        "exclude_modules": found.get("ignore"),
    }


def checkpoint_quantization(checkpoint: Path) -> tuple[dict[str, Any], Any]:
    """The quantization table and dtype of a checkpoint directory: TensorRT-LLM's config.json
    `quantization`, or the Hugging Face one's of the llmapi target (hf_quantization)."""
    try:
        config = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError):
        raise InputError(
            f"{checkpoint} has no readable config.json: pass a TensorRT-LLM checkpoint directory"
        ) from None
    if "architecture" not in config and "architectures" in config:  # a Hugging Face checkpoint
        return hf_quantization(checkpoint, config), config.get("dtype") or config.get("torch_dtype")
    return config.get("quantization") or {}, config.get("dtype")
