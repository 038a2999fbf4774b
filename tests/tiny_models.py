"""Tiny deterministic models for tests: real transformers models with random weights."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter.",
    "To make a cup of tea, first boil some water. Then pour it over the leaves and wait.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Photosynthesis is the process by which green plants use sunlight to make food.",
    "1, 2, 3, 5, 8, 13, 21, 34, 55, 89",
    "Les chats dorment beaucoup pendant la journée parce que la nuit ils chassent.",
    "The capital of France is Paris. The capital of Germany is Berlin.",
    "What is the boiling point of water at sea level? It is one hundred degrees Celsius.",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(path: Path, vocab_size: int = 384) -> None:
    """Train a small byte-level BPE tokenizer and save it as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def tiny_llama_config(vocab_size: int, **overrides: Any) -> Any:
    from transformers import LlamaConfig

    values: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        initializer_range=0.25,  # peaked logits: top-1 is meaningful, not a coin toss
    )
    values.update(overrides)
    config = LlamaConfig(**values)
    config.architectures = ["LlamaForCausalLM"]
    return config


def make_tiny_llama(path: Path, tokenizer_dir: Path, *, seed: int = 0, **overrides: Any) -> None:
    """Save a random LlamaForCausalLM (float32 safetensors) with the tokenizer beside it."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), **overrides)).eval()
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(path)
    for item in tokenizer_dir.iterdir():
        shutil.copy2(item, path / item.name)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "qwen2.5-vl")


def tiny_config(family: str, vocab_size: int, **overrides: Any) -> Any:
    """A 2-layer, hidden-64 config of one family (GQA where the family has it)."""
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.25, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    if family == "llama":
        return tiny_llama_config(vocab_size, **overrides)
    if family == "mistral":
        config = tf.MistralConfig(**{**common, "sliding_window": None, **overrides})
    elif family == "qwen2":
        config = tf.Qwen2Config(**{**common, "tie_word_embeddings": True, **overrides})
    elif family == "qwen3":
        config = tf.Qwen3Config(
            **{**common, "head_dim": 32, "tie_word_embeddings": True, **overrides}
        )
    elif family == "gpt2":
        gpt = dict(vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                   initializer_range=0.25, bos_token_id=1, eos_token_id=2)  # fmt: skip
        config = tf.GPT2Config(**{**gpt, **overrides})
    elif family == "qwen2.5-vl":
        text = {
            **common,
            "rope_parameters": {
                "rope_type": "default",
                "mrope_section": [2, 3, 3],
                "rope_theta": 10000.0,
            },
        }
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      fullatt_block_indexes=[0])  # fmt: skip
        config = tf.Qwen2_5_VLConfig(text_config={**text, **overrides}, vision_config=vision)
    else:
        raise ValueError(family)
    return config


def make_tiny(
    family: str, path: Path, tokenizer_dir: Path, *, seed: int = 0, **overrides: Any
) -> None:
    """Save a random model of `family` (float32 safetensors) with the tokenizer beside it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if family == "llama":
        make_tiny_llama(path, tokenizer_dir, seed=seed, **overrides)
        return
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    config = tiny_config(family, overrides.pop("vocab_size", len(tokenizer)), **overrides)
    if family == "qwen2.5-vl":
        from transformers import Qwen2_5_VLForConditionalGeneration

        model = Qwen2_5_VLForConditionalGeneration(config).eval()
    else:
        model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(path)
    for item in tokenizer_dir.iterdir():
        shutil.copy2(item, path / item.name)


#: Three tiny models, four entries: the nightly's test and benchmark fleet (`{int8}` is a line
#: for the int8 variant, e.g. a changed SmoothQuant alpha).
TINY_FLEET = """
[fleet]
name = "{name}"

[defaults.verify]
heldout_tokens = {heldout_tokens}

[[models]]
model = "tiny-llama"
  [[models.variants]]
  name = "fp16"
  dtype = "float16"
  [[models.variants]]
  name = "int8"
  dtype = "int8"
  {int8}
  [models.variants.verify]
  min_top1 = 0.8
  max_kl = 0.05

[[models]]
model = "tiny-qwen2"
  [[models.variants]]
  name = "bf16"
  dtype = "bfloat16"
  [models.variants.verify]
  min_top1 = 0.9
  max_kl = 0.01

[[models]]
model = "tiny-gpt2"
  [[models.variants]]
  name = "fp16"
  dtype = "float16"
"""


def tiny_fleet(name: str, *, heldout_tokens: int, int8: str = "") -> str:
    """TINY_FLEET's text; the models are next to the fleet file (make_fleet_models)."""
    return TINY_FLEET.format(name=name, heldout_tokens=heldout_tokens, int8=int8)


def make_fleet_models(root: Path, tokenizer_dir: Path) -> None:
    """tiny-llama, tiny-qwen2 and tiny-gpt2 under `root`."""
    for family in ("llama", "qwen2", "gpt2"):
        make_tiny(family, root / f"tiny-{family}", tokenizer_dir)
