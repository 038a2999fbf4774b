"""Qwen family: Qwen2ForCausalLM, Qwen3ForCausalLM, and the language model of
Qwen2_5_VLForConditionalGeneration (e.g. the text decoder of Cosmos-Reason1-7B)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .family import Family, TensorRule, register
from .llama import llama_style_config, llama_style_tensors, sliding_window_advice


def qwen_config(
    cfg: dict[str, Any], architecture: str, qwen_type: str, *, attn_bias: bool
) -> dict[str, Any]:
    """QWenConfig keys: `qwen_type` and `seq_length` have no defaults in TensorRT-LLM."""
    return {
        **llama_style_config(cfg, architecture),
        "qwen_type": qwen_type,
        "seq_length": cfg.get("seq_length", 8192),
        "attn_bias": attn_bias,  # qkv only: Qwen attention has no dense bias
        "mlp_bias": False,
        "use_logn_attn": False,
    }


def qwen2_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return qwen_config(cfg, "Qwen2ForCausalLM", "qwen2", attn_bias=True)


def qwen2_tensors(cfg: dict[str, Any], names: set[str]) -> Iterator[TensorRule]:
    return llama_style_tensors(cfg, names, qkv_bias=True)


def qwen3_config(cfg: dict[str, Any]) -> dict[str, Any]:
    # TensorRT-LLM's QWenConfig defaults attn_bias to True: Qwen3 must say False.
    return qwen_config(cfg, "Qwen3ForCausalLM", "qwen3", attn_bias=False)


def qwen3_tensors(cfg: dict[str, Any], names: set[str]) -> Iterator[TensorRule]:
    return llama_style_tensors(cfg, names, qk_norm=True)


def vl_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config: transformers 5 nests it in text_config, older files keep it flat.

    For text, the three M-RoPE position components are equal, so M-RoPE is plain 1-D rope with
    the same base: the mrope section is dropped and the decoder converted as Qwen2.
    """
    text = dict(cfg.get("text_config") or cfg)
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    params = dict(text.get("rope_parameters") or {})
    params.pop("mrope_section", None)
    text["rope_parameters"] = params
    scaling = text.get("rope_scaling") or {}
    if (
        scaling.get("type") == "mrope"
        or scaling.get("rope_type") in ("mrope", "default")
        or "mrope_section" in scaling
    ):
        text["rope_scaling"] = None
        if "rope_theta" not in params and "rope_theta" in text:
            params["rope_theta"] = text["rope_theta"]
    return text


def qwen2_5_vl_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return qwen2_config(vl_text_config(cfg))


def qwen2_5_vl_tensors(cfg: dict[str, Any], names: set[str]) -> Iterator[TensorRule]:
    # transformers >= 4.52 saves model.language_model.*, earlier releases model.*.
    prefix = (
        "model.language_model."
        if any(n.startswith("model.language_model.") for n in names)
        else "model."
    )
    return llama_style_tensors(vl_text_config(cfg), names, prefix=prefix, qkv_bias=True)


QWEN2 = register("Qwen2ForCausalLM")(
    Family(
        name="qwen2",
        config=qwen2_config,
        tensors=qwen2_tensors,
        ignored=("rotary_emb.inv_freq",),
        advice=sliding_window_advice,
    )
)
QWEN3 = register("Qwen3ForCausalLM")(
    Family(
        name="qwen3",
        config=qwen3_config,
        tensors=qwen3_tensors,
        ignored=("rotary_emb.inv_freq",),
        qk_norm=True,
        int8_kv_cache=False,  # calibrated ranges are taken before the q/k norms
        # TensorRT-LLM's SmoothQuant attention (quantization/layers.py: SmoothQuantAttention,
        # 0.20-1.2) has no q/k norm: an engine would drop Qwen3's with a warning
        smoothquant=False,
        min_release="1.0",  # the TensorRT backend gained Qwen3 in 1.0
        notes=(
            "Qwen3 engines need TensorRT-LLM 1.0 or later (the TensorRT backend gained Qwen3 in 1.0)",
        ),
    )
)
QWEN2_5_VL = register("Qwen2_5_VLForConditionalGeneration")(
    Family(
        name="qwen2.5-vl",
        config=qwen2_5_vl_config,
        tensors=qwen2_5_vl_tensors,
        ignored=("rotary_emb.inv_freq", "visual.", "model.visual."),
        vision_tower=("visual.", "model.visual."),  # the hub's, then transformers 4.52-4.57's
        notes=(
            "Qwen2.5-VL: only the language model is converted (as a Qwen2 decoder, text input); "
            "the vision tower is not, and TensorRT-LLM <= 1.2 has no engine for it",
        ),
        llmapi_notes=(
            "Qwen2.5-VL: the whole model is written, the vision tower unquantized in the "
            "checkpoint's dtype; verify and the reference backend run the language model "
            "(text input), TensorRT-LLM's llmapi model serves images",
        ),
    )
)
