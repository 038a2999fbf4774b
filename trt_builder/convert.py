"""HF checkpoint -> TensorRT-LLM checkpoint (config.json + rank{N}.safetensors), streamed.

Every name and shape is checked against the config before anything is written; then one HF
tensor set at a time is read, combined, checked for NaN/Inf, cast, split into its ranks and
written at its place in each rank file. Peak memory is about the largest tensor, whatever the
model's size.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from .errors import ConversionError, InputError
from .fetch import read_hf_config
from .models import Family, TensorRule, family_for
from .parallel import Mapping, check_mapping, shard
from .quant import QuantMode
from .safetensors_io import Check, SafetensorsIndex, StreamingWriter

_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_dtype(dtype: str, hf_config: dict[str, Any]) -> str:
    """`auto` is the checkpoint's own dtype, with float32 sources written as float16."""
    if dtype != "auto":
        return dtype
    text = hf_config.get("text_config") or {}
    source = (
        hf_config.get("dtype") or hf_config.get("torch_dtype") or text.get("dtype") or "float16"
    )
    return "float16" if source == "float32" or source not in _TORCH_DTYPES else str(source)


def trtllm_config(
    family: Family, hf_config: dict[str, Any], mode: QuantMode, *, tp: int = 1, pp: int = 1
) -> dict[str, Any]:
    config = family.config(hf_config)
    config.update(
        dtype=resolve_dtype(mode.dtype, hf_config),
        logits_dtype="float32",
        mapping={
            "world_size": tp * pp,
            "tp_size": tp,
            "pp_size": pp,
            "cp_size": 1,
            "gpus_per_node": 8,
        },
        quantization={
            "quant_algo": mode.quant_algo,
            "kv_cache_quant_algo": None,
            # null keeps TensorRT-LLM's default exclusions (lm_head, vocab_embedding, ...); a list
            # without vocab_embedding would turn the embedding into an INT8 layer the file cannot fill.
            "exclude_modules": None,
        },
    )
    return config


def weight_files(hf_dir: Path) -> list[Path]:
    """The checkpoint's weight files: those its index names, else every *.safetensors (so a
    repo that also ships another format's file, e.g. Mistral's consolidated.safetensors, works)."""
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
            f"{hf_dir} has no *.safetensors files: fetch converts or refuses other formats"
        )
    return files


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


def _load(rule: TensorRule, index: SafetensorsIndex) -> list[torch.Tensor]:
    """The rule's source tensors as views of the input files (Conv1D weights transposed)."""
    return [index.read(s).t() if rule.transpose else index.read(s) for s in rule.sources]


def _checker(rule: TensorRule, dtype: torch.dtype) -> Check:
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


#: How a rule's source tensors are rewritten before they are split and cast (the INT8 KV
#: cache's balancing, trt_builder/kvcache.py), by TensorRT-LLM name.
Rewrite = dict[str, Callable[[list[torch.Tensor]], list[torch.Tensor]]]


def _stream(
    rules: list[TensorRule],
    index: SafetensorsIndex,
    writers: list[StreamingWriter],
    mapping: Mapping,
    dtype: torch.dtype,
    rewrite: Rewrite | None = None,
) -> None:
    """Write every tensor; the kernel reads the next one ahead while this one is cast.

    One torch thread casts: the output's disk is the limit, and on a small host a second
    intra-op thread mostly spins (docs/benchmarks.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i, rule in enumerate(rules):
            if i + 1 < len(rules):
                index.prefetch(rules[i + 1].sources)
            _write_one(rule, index, writers, mapping, dtype, (rewrite or {}).get(rule.name))
    finally:
        torch.set_num_threads(threads)


def _write_one(
    rule: TensorRule,
    index: SafetensorsIndex,
    writers: list[StreamingWriter],
    mapping: Mapping,
    dtype: torch.dtype,
    rewrite: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
) -> None:
    """Map, split, cast, check and write one tensor, a block at a time. Its own function so
    that every view of the input mapping is gone when it returns."""
    # W8A16 linears too are written in the model dtype, [out, in]: trtllm-build quantizes
    # them at load into the GPU-specific layout its weight-only GEMM needs (docs/design.md).
    check = _checker(rule, dtype)
    parts = _load(rule, index)
    if rewrite is not None:
        parts = rewrite(parts)
    for rank, name, pieces in shard(rule.name, parts, mapping):
        writers[rank].write(name, pieces, check)


def convert_checkpoint(
    hf_dir: Path,
    out_dir: Path,
    mode: QuantMode,
    *,
    tp: int = 1,
    pp: int = 1,
    calibration: Path | None = None,
) -> dict[str, Any]:
    """Convert `hf_dir` into a TensorRT-LLM checkpoint in `out_dir`; return a summary. The
    INT8 KV cache (`mode.kv_int8`) takes its scales from the statistics in `calibration`."""
    family, config, rules, index, notes = plan_conversion(hf_dir, mode, tp=tp, pp=pp)
    mapping = Mapping.from_config(config)
    dtype = _TORCH_DTYPES[config["dtype"]]
    rewrite: Rewrite = {}
    extras: dict[str, torch.Tensor] = {}
    if getattr(mode, "kv_int8", False):
        with index:  # closed here if the statistics are refused
            rewrite, extras = _kv_cache(config, rules, calibration)
    plans: list[dict[str, tuple[torch.dtype, tuple[int, ...]]]] = [{} for _ in range(mapping.world)]
    for rule in rules:  # shapes per rank, from the same split code run on meta tensors
        for rank, name, pieces in shard(
            rule.name, [torch.empty(rule.shape, device="meta")], mapping
        ):
            plans[rank][name] = (dtype, (sum(p.shape[0] for p in pieces), *pieces[0].shape[1:]))
    for extra, tensor in extras.items():  # replicated across tensor-parallel ranks
        for rank, name, _ in shard(extra, [tensor], mapping):
            plans[rank][name] = (tensor.dtype, tuple(tensor.shape))
    with ExitStack() as stack:
        stack.enter_context(index)
        writers = [
            stack.enter_context(
                StreamingWriter(out_dir / f"rank{rank}.safetensors", plan, {"format": "pt"})
            )
            for rank, plan in enumerate(plans)
        ]
        _stream(rules, index, writers, mapping, dtype, rewrite)
        for extra, tensor in extras.items():
            for rank, name, pieces in shard(extra, [tensor], mapping):
                writers[rank].write(name, pieces)
    if extras:
        config["quantization"]["kv_cache_quant_algo"] = "INT8"
    return finish(out_dir, config, family, tensors=len(rules) + len(extras), notes=notes)


def _kv_cache(
    config: dict[str, Any], rules: list[TensorRule], calibration: Path | None
) -> tuple[Rewrite, dict[str, torch.Tensor]]:
    """The INT8 KV cache on a float or weight-only checkpoint: the balancing rewrite of every
    layer's qkv rows and dense input columns, and each layer's kv_cache_scaling_factor."""
    from .calibrate import load_stats
    from .kvcache import balance, qkv_ranges, refuse_unsupported

    refuse_unsupported(config, {r.name for r in rules})
    v_channels = config["quantization"]["quant_algo"] != "W8A16"  # see kvcache.balance
    if calibration is None:
        raise ConversionError("the INT8 KV cache needs a calibration: run trt-builder calibrate")
    stats = load_stats(calibration)
    rewrite: Rewrite = {}
    extras: dict[str, torch.Tensor] = {}
    for rule in rules:
        if not rule.name.endswith(".attention.qkv.weight"):
            continue
        prefix = rule.name.removesuffix("qkv.weight")
        kv = balance(qkv_ranges(stats, rule.sources), config, v_channels=v_channels)
        rewrite[rule.name] = rewrite[prefix + "qkv.bias"] = _scale_rows(kv.qkv_rows)
        rewrite[prefix + "dense.weight"] = _scale_columns(1.0 / kv.dense_in)
        extras[prefix + "kv_cache_scaling_factor"] = kv.scale
    return rewrite, extras


def _scale_rows(factors: torch.Tensor) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """Multiply the rows of the concatenated parts (e.g. q, k, v) by `factors`."""

    def apply(parts: list[torch.Tensor]) -> list[torch.Tensor]:
        out, row = [], 0
        for part in parts:
            n = part.shape[0]
            f = factors[row : row + n].reshape(n, *([1] * (part.dim() - 1)))
            out.append(part.float() * f)
            row += n
        return out

    return apply


def _scale_columns(factors: torch.Tensor) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    return lambda parts: [part.float() * factors[None, :] for part in parts]


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
