"""Llama family: LlamaForCausalLM (Llama 2/3/3.x, SmolLM2)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..errors import ConversionError
from . import Family, TensorRule, register

# Per layer: (TensorRT-LLM name, HF names, kind). Shapes come from `_shapes`.
LAYER_TABLE: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("input_layernorm.weight", ("input_layernorm.weight",), "norm"),
    (
        "attention.qkv.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "qkv",
    ),
    ("attention.dense.weight", ("self_attn.o_proj.weight",), "linear"),
    ("post_layernorm.weight", ("post_attention_layernorm.weight",), "norm"),
    ("mlp.fc.weight", ("mlp.gate_proj.weight",), "linear"),  # HF gate_proj is TRT-LLM's "fc"
    ("mlp.gate.weight", ("mlp.up_proj.weight",), "linear"),  # HF up_proj is TRT-LLM's "gate"
    ("mlp.proj.weight", ("mlp.down_proj.weight",), "linear"),
)

SUPPORTED_ROPE = ("default", "linear", "llama3")


def rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rotary_base, rotary_scaling) from a transformers 4 or 5 config."""
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or (
        params if params.get("rope_type", "default") != "default" else None
    )
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return theta, None
    if kind not in SUPPORTED_ROPE:
        raise ConversionError(
            f"rope type {kind!r} is not supported yet: supported are {', '.join(SUPPORTED_ROPE)}"
        )
    out = {k: v for k, v in scaling.items() if k not in ("rope_theta", "rope_type", "type")}
    # TensorRT-LLM reads the kind from "type"; keep HF's "rope_type" too for readers of either.
    return theta, {"type": kind, "rope_type": kind, **out}


def _dims(cfg: dict[str, Any]) -> dict[str, int]:
    heads = cfg["num_attention_heads"]
    return {
        "hidden": cfg["hidden_size"],
        "heads": heads,
        "kv_heads": cfg.get("num_key_value_heads") or heads,
        "head": cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "inter": cfg["intermediate_size"],
        "vocab": cfg["vocab_size"],
        "layers": cfg["num_hidden_layers"],
    }


def llama_config(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ConversionError(
            "Llama checkpoints with attention_bias or mlp_bias are not supported yet"
        )
    d = _dims(cfg)
    rotary_base, rotary_scaling = rope_settings(cfg)
    return {
        "architecture": "LlamaForCausalLM",
        "vocab_size": d["vocab"],
        "hidden_size": d["hidden"],
        "num_hidden_layers": d["layers"],
        "num_attention_heads": d["heads"],
        "num_key_value_heads": d["kv_heads"],
        "head_size": d["head"],
        "intermediate_size": d["inter"],
        "hidden_act": cfg.get("hidden_act", "silu"),
        "norm_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": cfg.get("max_position_embeddings", 2048),
        "rotary_base": rotary_base,
        "rotary_scaling": rotary_scaling,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "mlp_bias": False,
        "attn_bias": False,
    }


def llama_tensors(cfg: dict[str, Any]) -> Iterator[TensorRule]:
    d = _dims(cfg)
    shapes = {
        "norm": (d["hidden"],),
        "qkv": ((d["heads"] + 2 * d["kv_heads"]) * d["head"], d["hidden"]),
        "attention.dense.weight": (d["hidden"], d["heads"] * d["head"]),
        "mlp.fc.weight": (d["inter"], d["hidden"]),
        "mlp.gate.weight": (d["inter"], d["hidden"]),
        "mlp.proj.weight": (d["hidden"], d["inter"]),
    }
    yield TensorRule(
        "transformer.vocab_embedding.weight",
        ("model.embed_tokens.weight",),
        "embedding",
        (d["vocab"], d["hidden"]),
    )
    for i in range(d["layers"]):
        for name, sources, kind in LAYER_TABLE:
            shape = shapes.get(kind) or shapes[name]
            yield TensorRule(
                f"transformer.layers.{i}.{name}",
                tuple(f"model.layers.{i}.{s}" for s in sources),
                kind,
                shape,
            )
    yield TensorRule("transformer.ln_f.weight", ("model.norm.weight",), "norm", (d["hidden"],))
    head_source = (
        "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
    )
    yield TensorRule("lm_head.weight", (head_source,), "lm_head", (d["vocab"], d["hidden"]))


LLAMA = register("LlamaForCausalLM")(
    Family(
        name="llama",
        trtllm_architecture="LlamaForCausalLM",
        config=llama_config,
        tensors=llama_tensors,
        ignored=("rotary_emb.inv_freq",),
    )
)
