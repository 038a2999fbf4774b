"""Reading a TensorRT-LLM checkpoint back: config.json and every rank file, merged to one rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..core.errors import InputError
from ..targets.llmapi.checkpoint.unified import is_unified, read_unified
from .mapping import Mapping
from .parallel import merge


def read_checkpoint(checkpoint: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config, the TP=1 PP=1 tensors as stored) of a TensorRT-LLM checkpoint directory, or of
    the Hugging Face checkpoint of the llmapi target, read into one (targets/llmapi/checkpoint/unified.py)."""
    if is_unified(checkpoint):
        return read_unified(checkpoint)
    cfg_path = checkpoint / "config.json"
    if not cfg_path.is_file():
        raise InputError(
            f"{checkpoint} has no config.json: pass a TensorRT-LLM checkpoint directory"
        )
    config = json.loads(cfg_path.read_text())
    mapping = Mapping.from_config(config)
    ranks = []
    for rank in range(mapping.world):
        path = checkpoint / f"rank{rank}.safetensors"
        if not path.is_file():
            raise InputError(
                f"{checkpoint} lacks {path.name} (world size {mapping.world}): reconvert it"
            )
        with safe_open(str(path), framework="pt") as fh:
            ranks.append({name: fh.get_tensor(name) for name in fh.keys()})  # noqa: SIM118
    return config, ranks[0] if mapping.world == 1 else merge(ranks, mapping)
