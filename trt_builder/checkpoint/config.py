"""A TensorRT-LLM checkpoint's config.json from a Hugging Face config: the family's fields, the
dtype, the mapping and the quantization (convert writes it; targets/llmapi/checkpoint/unified.py rebuilds it
when it reads a Hugging Face checkpoint back)."""

from __future__ import annotations

from typing import Any

from ..core.dtypes import FLOATS
from ..models.family import Family


def resolve_dtype(dtype: str, hf_config: dict[str, Any]) -> str:
    """`auto` is the checkpoint's own dtype, with float32 sources written as float16."""
    if dtype != "auto":
        return dtype
    text = hf_config.get("text_config") or {}
    source = (
        hf_config.get("dtype") or hf_config.get("torch_dtype") or text.get("dtype") or "float16"
    )
    return "float16" if source == "float32" or source not in FLOATS else str(source)


def engine_config(
    family: Family,
    hf_config: dict[str, Any],
    dtype: str,
    *,
    quant_algo: str | None = None,
    kv_cache_quant_algo: str | None = None,
    exclude_modules: list[str] | None = None,
    tp: int = 1,
    pp: int = 1,
) -> dict[str, Any]:
    """The TensorRT-LLM config of `hf_config` in `dtype` (resolved: not `auto`)."""
    config = family.config(hf_config)
    config.update(
        dtype=dtype,
        logits_dtype="float32",
        mapping={
            "world_size": tp * pp,
            "tp_size": tp,
            "pp_size": pp,
            "cp_size": 1,
            "gpus_per_node": 8,
        },
        quantization={
            "quant_algo": quant_algo,
            "kv_cache_quant_algo": kv_cache_quant_algo,
            # null keeps TensorRT-LLM's default exclusions (lm_head, vocab_embedding, ...); a list
            # without vocab_embedding would turn the embedding into an INT8 layer the file cannot fill.
            "exclude_modules": exclude_modules,
        },
    )
    return config
