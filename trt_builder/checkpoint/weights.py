"""Which files of a Hugging Face checkpoint directory hold its weights (light: no torch, so a
cached run's stage keys can name them)."""

from __future__ import annotations

import json
from pathlib import Path

from ..core.errors import InputError


def weight_files(hf_dir: Path) -> list[Path]:
    """A Hugging Face checkpoint directory's weight files: those its index names, else every
    *.safetensors (so a repo that also ships another format's file, e.g. Mistral's
    consolidated.safetensors, works). fetch's output and the llmapi target's checkpoint alike."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            listed = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise InputError(
                f"{index.name} is not a valid weight index ({exc}): re-fetch the model"
            ) from None
        missing = [name for name in listed if not (hf_dir / name).is_file()]
        if missing:
            raise InputError(
                f"{missing[0]}, listed in {index.name}, is missing: re-fetch the model with --force"
            )
        return [hf_dir / name for name in listed]
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise InputError(
            f"{hf_dir} has no *.safetensors files: pass a Hugging Face checkpoint directory "
            "(fetch converts or refuses other formats)"
        )
    return files
