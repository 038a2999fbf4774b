"""The conversion plan: everything checked from the config and the safetensors headers before any output exists."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..checkpoint.config import engine_config, resolve_dtype
from ..checkpoint.mapping import check_mapping
from ..checkpoint.safetensors_io import SafetensorsIndex
from ..checkpoint.weights import weight_files
from ..core.errors import ConversionError
from ..models.family import Family, TensorRule
from ..models.registry import family_for
from ..modes import QuantMode
from ..source.files import read_hf_config


def trtllm_config(
    family: Family, hf_config: dict[str, Any], mode: QuantMode, *, tp: int = 1, pp: int = 1
) -> dict[str, Any]:
    dtype = resolve_dtype(mode.dtype, hf_config)
    return engine_config(family, hf_config, dtype, quant_algo=mode.quant_algo, tp=tp, pp=pp)


def plan_conversion(
    hf_dir: Path, mode: QuantMode, *, tp: int = 1, pp: int = 1
) -> tuple[Family, dict[str, Any], list[TensorRule], SafetensorsIndex, list[str]]:
    """Check everything that can be checked without reading weights: architecture, tp/pp,
    every expected tensor present with the shape the config implies, nothing left over.
    Also returns the notes to tell the user (the family's, and its advice for this config)."""
    hf_config = read_hf_config(hf_dir)
    family = family_for(hf_config)
    index = SafetensorsIndex(weight_files(hf_dir))
    names = set(index.names())
    try:
        config = trtllm_config(family, hf_config, mode, tp=tp, pp=pp)
        rules = list(family.tensors(hf_config, names))
    except KeyError as exc:
        raise ConversionError(
            f"config.json lacks {exc} (needed by the {family.name} family): fix the config"
        ) from None
    check_mapping(config, tp, pp)
    consumed: set[str] = set()
    for rule in rules:
        for source, expected in zip(rule.sources, rule.expected(), strict=True):
            if source not in index:
                raise ConversionError(
                    f"tensor {source} is missing from the HF checkpoint (needed for {rule.name})"
                )
            shape = index.entries[source].shape
            shape = tuple(reversed(shape)) if rule.transpose else shape
            if shape != expected:
                raise ConversionError(
                    f"{rule.name} ({source}) has shape {shape}, the config implies {expected}: "
                    "the weights do not match config.json"
                )
        consumed.update(rule.sources)
    if config.get("tie_word_embeddings"):
        consumed.add("lm_head.weight")  # some repos store the tied copy too
    leftover = sorted(n for n in names - consumed if not family.is_ignored(n))
    if leftover:
        raise ConversionError(
            f"{len(leftover)} HF tensor(s) are not mapped by the {family.name} family, e.g. {leftover[0]}: "
            "the checkpoint has parts this converter does not know"
        )
    return family, config, rules, index, [*family.notes, *family.advice(hf_config)]
