"""convert for `--target llmapi`: the mode's TensorRT-LLM checkpoint (TP=1, the converters of
the engine target, the recipe's rounding included), written out as the Hugging Face checkpoint
TensorRT-LLM's PyTorch backend and vLLM load (targets/llmapi/checkpoint/unified.py: the format; docs/llmapi.md:
what each loader reads, per release).

Beside the weights: config.json (the model's, with the checkpoint's dtype, the quantization
as `quantization_config`, and the keys transformers 4.57 reads: source/portable.py),
hf_quant_config.json for a quantized one, the tokenizer's files and generation_config.json
(`LLM(model=dir)` loads the tokenizer from the same directory), a vision-language model's
processor files (`LLM()` builds its AutoProcessor at start), and the recipe after a search.
A vision-language model's vision tower is copied from the source, unquantized.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from ...checkpoint.int4 import holds_int4
from ...checkpoint.reader import read_checkpoint
from ...convert.dispatch import checkpoint_writer
from ...convert.model import convert_model
from ...convert.plan import plan_conversion
from ...core.dtypes import torch_dtype
from ...core.errors import ConversionError
from ...models.family import Family
from ...modes import QuantMode
from ...modes.kvcache.convert import KVCacheScales
from ...source.files import PROCESSOR_FILES, TOKENIZER_FILES, read_hf_config
from ...source.portable import copy_portable, portable_config
from .checkpoint.loaders import CONTRACTS, check_unified
from .checkpoint.unified import (
    HF_QUANT,
    WEIGHTS,
    hf_tensors,
    quantization,
    tower_exclusions,
    vision_tensors,
)
from .spec import LlmApiTarget

#: The engine-format checkpoint, inside the output while it is made (removed after).
_ENGINE_FORMAT = ".trtllm-checkpoint"


def convert_llmapi(
    mode: QuantMode,
    hf_dir: Path,
    out_dir: Path,
    *,
    calibration: Path | None,
    recipe: Path | None,
) -> dict[str, Any]:
    """Write the Hugging Face checkpoint of `mode` into `out_dir` (empty), from the engine
    target's checkpoint (convert/model.py convert_model) at TP=1."""
    if LlmApiTarget().refusal(mode, ""):
        raise ConversionError(  # BuildSpec refuses these first; this is for the library's callers
            f"{mode.name} is not written for --target llmapi: use --dtype fp8 or float16"
        )
    engine_dir = out_dir / _ENGINE_FORMAT
    engine_dir.mkdir()
    summary = convert_model(mode, hf_dir, engine_dir, tp=1, pp=1, calibration=calibration,
                            recipe=recipe)  # fmt: skip
    config, tensors = read_checkpoint(engine_dir)
    family, _, rules, index, _ = plan_conversion(hf_dir, mode)
    tower = family.vision_tower
    quant = config["quantization"]
    names = {r.name for r in rules}
    extra = KVCacheScales.of(mode, config, family, names, calibration).hf_scales(rules)
    weight_only = torch_dtype(config["dtype"]) if mode.quantizes_hf_weights else None
    written = hf_tensors(tensors, rules, extra, weight_only, int4=holds_int4(mode))
    written.update(vision_tensors(index, tower, torch_dtype(config["dtype"])) if tower else {})
    index.close()
    save_file(written, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    del written
    hf_config = portable_config(read_hf_config(hf_dir))
    for part in (hf_config, *(hf_config.get(k) for k in ("text_config", "vision_config"))):
        if isinstance(part, dict):  # TensorRT-LLM reads the text_config's of a VL model
            part["dtype"] = part["torch_dtype"] = config["dtype"]
    hf_config.pop("quantization_config", None)
    embedding = next(r for r in rules if r.name == "transformer.vocab_embedding.weight")
    excluded = ["lm_head", embedding.sources[0].removesuffix(".weight")]
    excluded += tower_exclusions(tower) if tower else []
    files = quantization(mode, excluded, tower=bool(tower), fields=mode.hf_quant_fields(quant))
    if files is not None:
        hf_quant, hf_config["quantization_config"] = files
        (out_dir / HF_QUANT).write_text(json.dumps(hf_quant, indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    for name in (*TOKENIZER_FILES, *PROCESSOR_FILES):
        if (hf_dir / name).is_file():
            copy_portable(hf_dir / name, out_dir / name)
    if (engine_dir / "recipe.json").is_file():
        shutil.copy2(engine_dir / "recipe.json", out_dir / "recipe.json")
    shutil.rmtree(engine_dir)
    loaders = check_loaders(out_dir, quant["quant_algo"], tower=bool(tower))
    summary.update(
        format="huggingface",
        target="llmapi",
        files=sorted(p.name for p in out_dir.iterdir()),
        tp=1,
        pp=1,
        family=family.name,
        loaders=loaders,
        notes=llmapi_notes(
            summary.get("notes", []),
            family,
            hf_dir,
            quant["quant_algo"],
            loaders,
            instead=mode.INSTEAD_OF_REFUSING_LOADERS,
        ),  # fmt: skip
    )
    return summary


def check_loaders(out_dir: Path, quant_algo: str | None, *, tower: bool) -> list[str]:
    """The loaders that load the checkpoint in `out_dir` (targets/llmapi/checkpoint/loaders.py), each checked
    against it: a problem is a converter bug, caught before anyone loads it."""
    loaders = [c for c in CONTRACTS.values() if c.refusal(quant_algo, tower=tower) is None]
    for contract in loaders:
        problems = check_unified(out_dir, contract)
        if problems:
            raise ConversionError(
                f"the llmapi checkpoint does not conform to {contract.loader}: {problems[0]} "
                f"({len(problems)} problems)"
            )
    return [c.loader for c in loaders]


def llmapi_notes(
    notes: list[str],
    family: Family,
    hf_dir: Path,
    quant_algo: str | None,
    loaders: list[str],
    *,
    instead: str | None = None,
) -> list[str]:
    """What to tell the user: the family's llmapi notes in place of its engine ones, a missing
    processor, and which loaders refuse the checkpoint and why (grouped by reason), with the
    mode's way out (`instead`)."""
    tower = bool(family.vision_tower)
    if family.llmapi_notes is not None:
        notes = [n for n in notes if n not in family.notes] + list(family.llmapi_notes)
    if tower and not (hf_dir / "preprocessor_config.json").is_file():
        notes.append(
            "the model has no preprocessor_config.json, so none is in the checkpoint: "
            "TensorRT-LLM's LLM() and vLLM build the model's processor from it at start and "
            "fail without it (the reference backend serves text): add the model's processor "
            "files to its directory and rebuild"
        )
    refused: dict[str, list[str]] = {}
    for contract in CONTRACTS.values():
        why = contract.refusal(quant_algo, tower=tower)
        if why is not None:
            refused.setdefault(why, []).append(contract.loader)
    if refused:
        notes.append(
            f"the {quant_algo} llmapi checkpoint loads in {', '.join(loaders)}; "
            + "; ".join(f"{', '.join(names)} {why}" for why, names in refused.items())
            + (f": {instead}" if instead else "")
        )
    return notes


@checkpoint_writer.register(LlmApiTarget)
def _llmapi(target: LlmApiTarget, mode: QuantMode, hf_dir: Path, out_dir: Path, *, tp: int,
            pp: int, calibration: Path | None, recipe: Path | None,
            remember: Callable[[Path, str], None] | None) -> dict[str, Any]:  # fmt: skip
    """One Hugging Face checkpoint whatever the spec's TP and PP (serving's choice)."""
    return convert_llmapi(mode, hf_dir, out_dir, calibration=calibration, recipe=recipe)
