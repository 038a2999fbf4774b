"""The files of a Hugging Face model directory: which ones fetch keeps, its config.json, and the checks that refuse a model before any work."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Any

from ..core.errors import InputError

#: The tokenizer's files, and the generation config that carries the end ids.
TOKENIZER_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


#: A vision-language model's processor files: `AutoProcessor.from_pretrained` (which
#: TensorRT-LLM's `LLM()` and vLLM run at start for Qwen2.5-VL) needs preprocessor_config.json;
#: the chat template is among the tokenizer's files.
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)


#: At least one of these: the tokenizer itself.
TOKENIZER_MODELS = ("tokenizer.json", "tokenizer.model", "vocab.json")


#: Files kept from a model repo; weights are safetensors unless pickles are explicitly allowed.
KEEP_PATTERNS = ("config.json", *TOKENIZER_FILES, *PROCESSOR_FILES, "*.safetensors",
                 "model.safetensors.index.json")  # fmt: skip


PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


PICKLE_FIX = (
    "trt-builder loads safetensors only; convert the weights to safetensors, "
    "or pass --allow-pickle to load them with torch.load(weights_only=True)"
)


def matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def check_weight_files(names: list[str], where: str, allow_pickle: bool) -> None:
    """Refuse a model with no safetensors weights, unless pickles are allowed and present."""
    if any(fnmatch.fnmatch(n, "*.safetensors") for n in names):
        return
    pickles = [n for n in names if matches(n, PICKLE_PATTERNS)]
    if pickles and not allow_pickle:
        raise InputError(f"{where} has only pickle weights ({pickles[0]}, ...): {PICKLE_FIX}")
    if not pickles:
        raise InputError(
            f"{where} has no weights (*.safetensors): pass a model directory or repo with weights"
        )


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    path = hf_dir / "config.json"
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise InputError(
            f"{hf_dir} has no config.json: pass a Hugging Face model directory"
        ) from None
    except (OSError, ValueError, TypeError) as exc:
        raise InputError(
            f"{path} is not valid JSON ({exc}): fix or re-download the model"
        ) from None


def check_model_dir(hf_dir: Path) -> None:
    """Refuse a model that needs repository code, or has no tokenizer to verify and serve with."""
    config = read_hf_config(hf_dir)
    if "auto_map" in config or "_attn_implementation_internal" in config:
        raise InputError(
            "config.json asks for custom repository code (auto_map): trt-builder never runs repo code; "
            "use a model whose architecture transformers ships"
        )
    if not any((hf_dir / name).is_file() for name in TOKENIZER_MODELS):
        raise InputError(
            f"the model has no tokenizer ({', '.join(TOKENIZER_MODELS)}): verify and Triton need it; "
            "add the tokenizer files to the model directory"
        )


def model_files(src: Path) -> list[Path]:
    """The top-level files of a local model that fetch reads (weights, pickles, config, tokenizer)."""
    patterns = KEEP_PATTERNS + PICKLE_PATTERNS
    return sorted(p for p in src.iterdir() if p.is_file() and matches(p.name, patterns))
