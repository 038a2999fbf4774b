"""GPT-2: GPT2LMHeadModel (Conv1D weights stored [in, out], learned positions, LayerNorm, biases)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .family import Family, TensorRule, register

# Per layer: (TensorRT-LLM name, HF name under `transformer.h.N.`, shape key, Conv1D).
LAYER_TABLE: tuple[tuple[str, str, str, bool], ...] = (
    ("input_layernorm.weight", "ln_1.weight", "hidden", False),
    ("input_layernorm.bias", "ln_1.bias", "hidden", False),
    ("attention.qkv.weight", "attn.c_attn.weight", "qkv", True),  # q, k, v already fused
    ("attention.qkv.bias", "attn.c_attn.bias", "qkv_bias", False),
    ("attention.dense.weight", "attn.c_proj.weight", "square", True),
    ("attention.dense.bias", "attn.c_proj.bias", "hidden", False),
    ("post_layernorm.weight", "ln_2.weight", "hidden", False),
    ("post_layernorm.bias", "ln_2.bias", "hidden", False),
    ("mlp.fc.weight", "mlp.c_fc.weight", "up", True),
    ("mlp.fc.bias", "mlp.c_fc.bias", "inter", False),
    ("mlp.proj.weight", "mlp.c_proj.weight", "down", True),
    ("mlp.proj.bias", "mlp.c_proj.bias", "hidden", False),
)


def _sizes(cfg: dict[str, Any]) -> tuple[int, int, int, int, int]:
    hidden = cfg["n_embd"]
    return (
        hidden,
        cfg.get("n_inner") or 4 * hidden,
        cfg["n_head"],
        cfg["n_layer"],
        cfg["vocab_size"],
    )


def gpt2_config(cfg: dict[str, Any]) -> dict[str, Any]:
    hidden, inter, heads, layers, vocab = _sizes(cfg)
    return {
        "architecture": "GPT2LMHeadModel",
        "gpt_variant": "gpt2",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_size": hidden // heads,
        "intermediate_size": inter,
        # TensorRT-LLM's own converter passes HF's name through; its gelu is the tanh form.
        "hidden_act": cfg.get("activation_function", "gelu_new"),
        "norm_epsilon": float(cfg.get("layer_norm_epsilon", 1e-5)),
        "position_embedding_type": "learned_absolute",
        "max_position_embeddings": cfg["n_positions"],
        "bias": True,
        "apply_query_key_layer_scaling": False,
        "rotary_pct": 1.0,
        "rotary_base": 10000.0,
        "rotary_scaling": None,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "share_embedding_table": False,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
    }


def gpt2_tensors(cfg: dict[str, Any], names: set[str]) -> Iterator[TensorRule]:
    hidden, inter, _, layers, vocab = _sizes(cfg)
    # The hub's original GPT-2 files (gpt2, gpt2-xl, distilgpt2) store `wte.weight`, `h.0...`;
    # files saved from GPT2LMHeadModel store `transformer.wte.weight`, ...
    p = "transformer." if "transformer.wte.weight" in names else ""
    shapes = {
        "hidden": (hidden,),
        "inter": (inter,),
        "qkv": (3 * hidden, hidden),
        "qkv_bias": (3 * hidden,),
        "square": (hidden, hidden),
        "up": (inter, hidden),
        "down": (hidden, inter),
    }
    yield TensorRule("transformer.vocab_embedding.weight", (f"{p}wte.weight",), (vocab, hidden))
    yield TensorRule(
        "transformer.position_embedding.weight",
        (f"{p}wpe.weight",),
        (cfg["n_positions"], hidden),
    )
    for i in range(layers):
        for name, source, shape, conv1d in LAYER_TABLE:
            yield TensorRule(
                f"transformer.layers.{i}.{name}",
                (f"{p}h.{i}.{source}",),
                shapes[shape],
                conv1d,
            )
    yield TensorRule("transformer.ln_f.weight", (f"{p}ln_f.weight",), (hidden,))
    yield TensorRule("transformer.ln_f.bias", (f"{p}ln_f.bias",), (hidden,))
    head = "lm_head.weight" if "lm_head.weight" in names else f"{p}wte.weight"  # tied by default
    yield TensorRule("lm_head.weight", (head,), (vocab, hidden))


GPT2 = register("GPT2LMHeadModel")(
    Family(
        name="gpt2",
        config=gpt2_config,
        tensors=gpt2_tensors,
        ignored=(".attn.bias", ".attn.masked_bias"),
        gated_mlp=False,  # fc -> gelu -> proj
        smoothquant=True,  # the smoothers of qkv and fc fold into the LayerNorms' weight and bias
        decoder_layer=r"(^|\.)h\.\d+\.",  # transformer.h.N
        # tensorrt_llm/_torch/models has no modeling_gpt2 (main, read 2026-12)
        no_llmapi="TensorRT-LLM's PyTorch backend has no GPT-2 model: use --target engine",
    )
)
