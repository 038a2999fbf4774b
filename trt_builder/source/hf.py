"""The fetched HF model as torch sees it: its tokenizer, end ids, the transformers model, and the device to run it on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..core.errors import InputError


def pick_device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise InputError(
            "verify device cuda was asked for but torch sees no CUDA GPU: use --device cpu"
        )
    return choice


def end_ids(hf_dir: Path, tokenizer: Any) -> set[int]:
    """End-of-sequence ids from generation_config.json and the tokenizer."""
    ids: set[int] = set()
    gen = hf_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def load_hf_model(hf_dir: Path, **kwargs: Any) -> Any:
    """The transformers model (float32 unless `kwargs` say otherwise): a causal LM, or a
    vision-language model whose language model was converted (its text path is what runs)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    return model_class(config).from_pretrained(hf_dir, **{"dtype": torch.float32, **kwargs})


def model_class(config: Any) -> Any:
    """The transformers auto class that loads a model of `config`: a causal LM, or a
    vision-language model (its text path is what runs)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if type(config) in AutoModelForCausalLM._model_mapping:
        return AutoModelForCausalLM
    return AutoModelForImageTextToText


def load_tokenizer(directory: Path, what: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(
            f"transformers cannot load a tokenizer from {directory} ({exc}): pass {what}"
        ) from None
