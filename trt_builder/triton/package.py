"""What the package stage ships: the tokenizer, the engine built from the current checkpoint
(by trt-builder or by hand), and the repository options read from that engine's config (or
the config its build command will give it)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..core.errors import PackageError
from ..core.stage import BuildContext, built_from, read_marker
from ..engine.build import check_engine, planned_engine_config
from ..source import files
from .llmapi import CHECKPOINT, MODEL, LlmapiOptions
from .repository import RepositoryOptions, options_from_engine

#: Checkpoint fields an engine's config.json (pretrained_config) must agree on.
ENGINE_MATCH_FIELDS = (
    "architecture",
    "dtype",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "rotary_base",
)


def engine_matches_checkpoint(engine: Path, checkpoint: Path) -> bool:
    try:
        built = json.loads((engine / "config.json").read_text()).get("pretrained_config", {})
        config = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError):
        return False
    same = all(built.get(k) == config.get(k) for k in ENGINE_MATCH_FIELDS)
    algo = (built.get("quantization") or {}).get("quant_algo")
    return same and algo == (config.get("quantization") or {}).get("quant_algo")


# AutoTokenizer also reads model_type from config.json.
TOKENIZER_FILES = (*files.TOKENIZER_FILES, "config.json")


def tokenizer_files(ctx: BuildContext) -> list[Path]:
    """The tokenizer files of hf/ that the preprocessing and postprocessing models load."""
    return [ctx.layout.hf / n for n in TOKENIZER_FILES if (ctx.layout.hf / n).is_file()]


def shipped_engine(ctx: BuildContext) -> Path | None:
    """The engine to ship: built (by trt-builder or by hand) from the current checkpoint, and
    unchanged since its build; None (and a notice) for another checkpoint's engine."""
    engine = ctx.layout.engine
    if not (engine / "rank0.engine").is_file():
        return None
    if read_marker(engine) is not None:
        current = built_from(ctx, engine, "checkpoint", ctx.layout.checkpoint)
    else:  # built by hand with the printed command: compare what the engine was built from
        current = engine_matches_checkpoint(engine, ctx.layout.checkpoint)
    if not current:
        notice = f"{engine} was built from another checkpoint and is left out: rebuild it"
        if notice not in ctx.notices:
            ctx.notices.append(notice)
        return None
    note = check_engine(engine, digest=ctx.digests.file)  # refuses a changed engine
    if note is not None and note not in ctx.notices:
        ctx.notices.append(note)
    return engine


def engine_config(ctx: BuildContext, engine: Path | None) -> dict[str, Any]:
    """The engine's own config.json, or the one the build command will give it."""
    if engine is not None:
        config = json.loads((engine / "config.json").read_text())
    else:
        checkpoint = json.loads((ctx.layout.checkpoint / "config.json").read_text())
        config = planned_engine_config(ctx.spec, checkpoint)
    world = (config.get("pretrained_config", {}).get("mapping") or {}).get("world_size", 1)
    if world != ctx.spec.tp * ctx.spec.pp:
        raise PackageError(
            f"the engine's world size is {world}, the spec's tp x pp is "
            f"{ctx.spec.tp * ctx.spec.pp}: rebuild the engine (trt-builder engine --force)"
        )
    return config


def backend(ctx: BuildContext, engine: Path | None) -> str:
    """The tensorrt_llm model's backend: [triton] backend, where "auto" is the engine when one
    was built from this checkpoint (`engine`, shipped_engine's), else the reference backend."""
    chosen = ctx.spec.triton.backend
    if chosen == "auto":
        return "tensorrtllm" if engine is not None else "reference"
    return chosen


def repository_options(ctx: BuildContext, version: int, engine: Path | None) -> RepositoryOptions:
    """The repository's options for published version `version`, from the engine's config and
    the spec's [triton] table; `engine` is shipped_engine's."""
    triton = ctx.spec.triton
    root = triton.serve_root or str(ctx.layout.triton_root.resolve())
    kind = backend(ctx, engine)
    options = options_from_engine(
        engine_config(ctx, engine if kind == "tensorrtllm" else None),
        engine_path=f"{root}/{ctx.layout.triton_name}/tensorrt_llm/{version}/engine",
        version=version,
        decoupled=triton.streaming,
        kv_cache_free_gpu_mem_fraction=triton.kv_cache_free_gpu_mem_fraction,
    )
    return replace(options, backend=kind)


def llmapi_backend(chosen: str) -> str:
    """The llmapi model's backend for [triton] backend `chosen`: "auto" is "tensorrtllm" (the
    template's model.py, TensorRT-LLM's own) where TensorRT-LLM is installed, as the engine
    target's auto is its backend where the engine was built; else "reference"."""
    if chosen != "auto":
        return chosen
    return "tensorrtllm" if importlib.util.find_spec("tensorrt_llm") is not None else "reference"


def llmapi_options(ctx: BuildContext, version: int) -> LlmapiOptions:
    """The llmapi repository's options for published version `version`: the memory plan's
    limits (as `LLM()` arguments), tp and pp, the [triton] table, and the checkpoint's path
    where the serving host sees the repository. [triton] backend auto is TensorRT-LLM's own
    model where TensorRT-LLM is installed (the NGC container), else the reference backend."""
    triton, limits = ctx.spec.triton, ctx.spec.limits
    root = triton.serve_root or str(ctx.layout.triton_root.resolve())
    if limits.max_batch_size is None or limits.max_num_tokens is None:
        raise PackageError("internal: the llmapi repository needs the memory plan's limits")
    return LlmapiOptions(
        model_path=f"{root}/{ctx.layout.triton_name}/{MODEL}/{version}/{CHECKPOINT}",
        max_batch_size=limits.max_batch_size,
        max_num_tokens=limits.max_num_tokens,
        max_seq_len=limits.max_seq_len,
        version=version,
        tp=ctx.spec.tp,
        pp=ctx.spec.pp,
        decoupled=triton.streaming,
        kv_cache_free_gpu_mem_fraction=triton.kv_cache_free_gpu_mem_fraction,
        backend=llmapi_backend(triton.backend),
    )
