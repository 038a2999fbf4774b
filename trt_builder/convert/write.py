"""What every converter shares when writing: the source tensors of a rule, the NaN/range check, and the checkpoint's config.json."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.safetensors_io import Check, SafetensorsIndex
from ..core.errors import ConversionError
from ..models.family import Family, TensorRule


def load_sources(rule: TensorRule, index: SafetensorsIndex) -> list[torch.Tensor]:
    """The rule's source tensors as views of the input files (Conv1D weights transposed)."""
    return rule.read(index)


def checker(rule: TensorRule, dtype: torch.dtype) -> Check:
    """Refuses, by name, a block whose cast values are not finite: NaN or Inf in the source,
    or values beyond the target dtype's range (they became Inf in the cast). Checking the cast
    block, which is still in the cache, costs no second pass over the source."""

    def check(block: torch.Tensor, source: torch.Tensor) -> None:
        if not block.is_floating_point():
            return
        low, high = (float(v) for v in torch.aminmax(block))  # NaN and Inf propagate
        if math.isfinite(low) and math.isfinite(high):
            return
        if not bool(torch.isfinite(source).all()):
            raise ConversionError(
                f"{rule.name} ({', '.join(rule.sources)}) contains NaN or Inf values"
            )
        name = str(dtype).removeprefix("torch.")
        raise ConversionError(
            f"{rule.name} ({', '.join(rule.sources)}) has values beyond {name}'s range: "
            "convert with --dtype bfloat16 (or float32)"
        )

    return check


def finish(
    out_dir: Path, config: dict[str, Any], family: Family, *, tensors: int, notes: list[str]
) -> dict[str, Any]:
    """Write the checkpoint's config.json (after its rank files) and return the summary."""
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    quant, mapping = config["quantization"], config["mapping"]
    return {
        "architecture": config["architecture"],
        "family": family.name,
        "dtype": config["dtype"],
        "quant_algo": quant["quant_algo"],
        "kv_cache_quant_algo": quant["kv_cache_quant_algo"],
        "tp": mapping["tp_size"],
        "pp": mapping["pp_size"],
        "tensors": tensors,
        "rotary_base": config.get("rotary_base"),
        "rotary_scaling": config.get("rotary_scaling"),
        "notes": notes,
    }
