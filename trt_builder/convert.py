"""HF checkpoint -> TensorRT-LLM checkpoint (config.json + rank0.safetensors)."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import ConversionError, InputError, SpecError
from .fetch import read_hf_config
from .models import Family, TensorRule, family_for
from .quant import QuantMode

_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class SafetensorsReader:
    """Lazy, memory-mapped access to every tensor of an HF checkpoint's *.safetensors files."""

    def __init__(self, hf_dir: Path, stack: ExitStack) -> None:
        files = sorted(hf_dir.glob("*.safetensors"))
        if not files:
            raise InputError(
                f"{hf_dir} has no *.safetensors files: fetch converts or refuses other formats"
            )
        self.where: dict[str, Any] = {}
        for path in files:
            try:
                handle = stack.enter_context(safe_open(str(path), framework="pt"))
            except Exception as exc:  # safetensors raises its own error types for bad headers
                raise InputError(
                    f"{path.name} is not a readable safetensors file ({exc}): re-fetch with --force"
                ) from None
            for name in handle.keys():  # noqa: SIM118
                self.where[name] = handle

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise ConversionError(f"tensor {name} is missing from the HF checkpoint")
        return self.where[name].get_tensor(name)


def _check(rule: TensorRule, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != rule.shape:
        raise ConversionError(
            f"{rule.name} ({', '.join(rule.sources)}) has shape {tuple(tensor.shape)}, "
            f"the config implies {rule.shape}: the weights do not match config.json"
        )
    if tensor.is_floating_point() and not torch.isfinite(tensor).all():
        raise ConversionError(f"{rule.name} ({', '.join(rule.sources)}) contains NaN or Inf values")


def trtllm_config(family: Family, hf_config: dict[str, Any], mode: QuantMode) -> dict[str, Any]:
    config = family.config(hf_config)
    config.update(
        dtype=mode.dtype,
        logits_dtype="float32",
        mapping={"world_size": 1, "tp_size": 1, "pp_size": 1, "cp_size": 1, "gpus_per_node": 8},
        quantization={
            "quant_algo": mode.quant_algo,
            "kv_cache_quant_algo": None,
            # null keeps TensorRT-LLM's default exclusions (lm_head, vocab_embedding, ...); a list
            # without vocab_embedding would turn the embedding into an INT8 layer the file cannot fill.
            "exclude_modules": None,
        },
    )
    return config


def convert_checkpoint(
    hf_dir: Path, out_dir: Path, mode: QuantMode, *, tp: int = 1, pp: int = 1
) -> dict[str, Any]:
    """Convert `hf_dir` into a TensorRT-LLM checkpoint in `out_dir`; return a summary."""
    if tp != 1 or pp != 1:
        raise SpecError(
            "tensor/pipeline-parallel conversion is not implemented yet: build with --tp 1 --pp 1"
        )
    hf_config = read_hf_config(hf_dir)
    family = family_for(hf_config)
    config = trtllm_config(family, hf_config, mode)
    dtype = _TORCH_DTYPES[mode.dtype]
    out: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        reader = SafetensorsReader(hf_dir, stack)
        consumed: set[str] = set()
        for rule in family.tensors(hf_config):
            parts = [reader.get(s) for s in rule.sources]
            consumed.update(rule.sources)
            tensor = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
            _check(rule, tensor)
            # W8A16 linears too are written in the model dtype, [out, in]: trtllm-build quantizes
            # them at load into the GPU-specific layout its weight-only GEMM needs (docs/design.md).
            out[rule.name] = tensor.to(dtype, copy=True).contiguous()  # never a view of the mmap
        if config["tie_word_embeddings"]:
            consumed.add("lm_head.weight")  # some repos store the tied copy too
        leftover = sorted(n for n in set(reader.where) - consumed if not n.endswith(family.ignored))
        if leftover:
            raise ConversionError(
                f"{len(leftover)} HF tensor(s) are not mapped by the {family.name} family, e.g. {leftover[0]}: "
                "the checkpoint has parts this converter does not know"
            )
    save_file(out, str(out_dir / "rank0.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return {
        "architecture": config["architecture"],
        "family": family.name,
        "dtype": mode.dtype,
        "quant_algo": mode.quant_algo,
        "tensors": len(out),
        "rotary_base": config.get("rotary_base"),
        "rotary_scaling": config.get("rotary_scaling"),
    }
