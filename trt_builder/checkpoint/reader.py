"""Reading a TensorRT-LLM checkpoint back: config.json and every rank file, merged to one rank."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..core.errors import InputError
from ..modes import mode_of
from ..targets.llmapi.checkpoint.unified import is_unified, read_unified
from .int4 import holds_int4, pack_rows, unpack_rows
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
    if mapping.world == 1:
        return config, ranks[0]
    packed = _packs_int4(config)
    if packed:  # the ranks' INT4 rows are merged as values, then packed as one rank packs them
        ranks = [{k: unpack_rows(v) if packed(k, v) else v for k, v in r.items()} for r in ranks]
    merged = merge(ranks, mapping)
    return config, {k: pack_rows(v) if packed and packed(k, v) else v for k, v in merged.items()}


def _packs_int4(config: dict[str, Any]) -> Callable[[str, torch.Tensor], bool] | None:
    """Which tensors hold packed INT4 rows, for a checkpoint whose mode stores them (its
    linears' int8 weights), else None."""
    if not holds_int4(
        mode_of(config.get("quantization") or {}, str(config.get("dtype", "float16")))
    ):
        return None
    return lambda name, t: name.endswith(".weight") and t.dtype == torch.int8
