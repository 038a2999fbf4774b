"""Llama-style decoders: LlamaForCausalLM (Llama 2, 3, 3.1/3.2, SmolLM2), MistralForCausalLM.

The tables and builders here also serve the Qwen family (models/qwen.py), whose checkpoints
share Llama's names.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..core.errors import ConversionError
from .family import Family, TensorRule, register
from .shape import AttentionShape

# Per layer: (TensorRT-LLM name, HF names under `<prefix>layers.N.`, shape key).
LAYER_TABLE: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("input_layernorm.weight", ("input_layernorm.weight",), "hidden"),
    ("attention.qkv.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv"),
    ("attention.dense.weight", ("self_attn.o_proj.weight",), "dense"),
    ("post_layernorm.weight", ("post_attention_layernorm.weight",), "hidden"),
    ("mlp.fc.weight", ("mlp.gate_proj.weight",), "up"),  # HF gate_proj is TRT-LLM's "fc"
    ("mlp.gate.weight", ("mlp.up_proj.weight",), "up"),  # HF up_proj is TRT-LLM's "gate"
    ("mlp.proj.weight", ("mlp.down_proj.weight",), "down"),
)  # fmt: skip
QKV_BIAS_ROW = ("attention.qkv.bias", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv_bias")  # Qwen2  # fmt: skip
QK_NORM_ROWS = (  # Qwen3: RMSNorm over each head of q and k, before rope
    ("attention.q_layernorm.weight", ("self_attn.q_norm.weight",), "head"),
    ("attention.k_layernorm.weight", ("self_attn.k_norm.weight",), "head"),
)

SUPPORTED_ROPE = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Dims:
    hidden: int
    heads: int
    kv_heads: int
    head: int
    inter: int
    vocab: int
    layers: int

    @classmethod
    def of(cls, cfg: dict[str, Any]) -> Dims:
        attention = AttentionShape.of(cfg)
        return cls(
            hidden=cfg["hidden_size"],
            heads=attention.heads,
            kv_heads=attention.kv_heads,
            head=attention.head_size,
            inter=cfg["intermediate_size"],
            vocab=cfg["vocab_size"],
            layers=cfg["num_hidden_layers"],
        )

    def shapes(self) -> dict[str, tuple[int, ...]]:
        qkv = (self.heads + 2 * self.kv_heads) * self.head
        return {
            "hidden": (self.hidden,),
            "qkv": (qkv, self.hidden),
            "qkv_bias": (qkv,),
            "q": (self.heads * self.head, self.hidden),
            "kv": (self.kv_heads * self.head, self.hidden),
            "dense": (self.hidden, self.heads * self.head),
            "up": (self.inter, self.hidden),
            "down": (self.hidden, self.inter),
            "head": (self.head,),
        }


def rope_settings(
    cfg: dict[str, Any], supported: tuple[str, ...] = SUPPORTED_ROPE
) -> tuple[float, dict[str, Any] | None]:
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
    if kind not in supported:
        raise ConversionError(
            f"rope type {kind!r} is not supported yet: supported are {', '.join(supported)}"
        )
    out = {k: v for k, v in scaling.items() if k not in ("rope_theta", "rope_type", "type")}
    # TensorRT-LLM reads the kind from "type"; keep HF's "rope_type" too for readers of either.
    return theta, {"type": kind, "rope_type": kind, **out}


def llama_style_config(
    cfg: dict[str, Any], architecture: str, *, rope: tuple[str, ...] = SUPPORTED_ROPE
) -> dict[str, Any]:
    """TensorRT-LLM config fields shared by Llama-style decoders."""
    d = Dims.of(cfg)
    rotary_base, rotary_scaling = rope_settings(cfg, rope)
    return {
        "architecture": architecture,
        "vocab_size": d.vocab,
        "hidden_size": d.hidden,
        "num_hidden_layers": d.layers,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.kv_heads,
        "head_size": d.head,
        "intermediate_size": d.inter,
        "hidden_act": cfg.get("hidden_act", "silu"),
        "norm_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": cfg.get("max_position_embeddings", 2048),
        "rotary_base": rotary_base,
        "rotary_scaling": rotary_scaling,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }


def llama_style_tensors(
    cfg: dict[str, Any],
    names: set[str],
    *,
    prefix: str = "model.",
    qkv_bias: bool = False,
    qk_norm: bool = False,
) -> Iterator[TensorRule]:
    """Embedding, layers, final norm and lm_head of a Llama-style HF checkpoint."""
    d = Dims.of(cfg)
    shapes = d.shapes()
    rows = LAYER_TABLE + ((QKV_BIAS_ROW,) if qkv_bias else ()) + (QK_NORM_ROWS if qk_norm else ())
    yield TensorRule(
        "transformer.vocab_embedding.weight", (f"{prefix}embed_tokens.weight",), (d.vocab, d.hidden)
    )
    per_source = {  # q, k and v separately, so a wrong split between them is caught
        "qkv": (shapes["q"], shapes["kv"], shapes["kv"]),
        "qkv_bias": (shapes["q"][:1], shapes["kv"][:1], shapes["kv"][:1]),
    }
    for i in range(d.layers):
        for name, sources, shape in rows:
            yield TensorRule(
                f"transformer.layers.{i}.{name}",
                tuple(f"{prefix}layers.{i}.{s}" for s in sources),
                shapes[shape],
                source_shapes=per_source.get(shape, ()),
            )
    yield TensorRule("transformer.ln_f.weight", (f"{prefix}norm.weight",), (d.hidden,))
    head = f"{prefix}embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
    yield TensorRule("lm_head.weight", (head,), (d.vocab, d.hidden))


def _no_bias(cfg: dict[str, Any]) -> None:
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ConversionError(
            "Llama checkpoints with attention_bias or mlp_bias are not supported yet"
        )


def llama_config(cfg: dict[str, Any]) -> dict[str, Any]:
    _no_bias(cfg)
    return {**llama_style_config(cfg, "LlamaForCausalLM"), "mlp_bias": False, "attn_bias": False}


def mistral_config(cfg: dict[str, Any]) -> dict[str, Any]:
    # Sliding-window attention is a runtime setting in TensorRT-LLM (max_attention_window_size).
    return {**llama_style_config(cfg, "MistralForCausalLM"), "mlp_bias": False, "attn_bias": False}


def sliding_window_advice(cfg: dict[str, Any]) -> list[str]:
    """Sliding-window attention is not in the checkpoint: say how to serve it."""
    window = cfg.get("sliding_window")
    used = cfg.get("use_sliding_window", True)  # Qwen2 has a switch; Mistral does not
    if used and isinstance(window, int) and window < cfg.get("max_position_embeddings", window + 1):
        return [
            f"sliding-window attention (window {window}) is a runtime setting in TensorRT-LLM: "
            f"serve with max_attention_window_size={window} (Triton: the tensorrt_llm parameter of that name)"
        ]
    return []


LLAMA = register("LlamaForCausalLM")(
    Family(
        name="llama",
        config=llama_config,
        tensors=llama_style_tensors,
        ignored=("rotary_emb.inv_freq",),
    )
)
MISTRAL = register("MistralForCausalLM")(
    Family(
        name="mistral",
        config=mistral_config,
        advice=sliding_window_advice,
        tensors=llama_style_tensors,
        ignored=("rotary_emb.inv_freq",),
    )
)
