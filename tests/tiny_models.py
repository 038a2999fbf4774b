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
