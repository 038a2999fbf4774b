"""What the package stage ships: the tokenizer, the engine built from the current checkpoint
(by trt-builder or by hand), and the repository options read from that engine's config (or
the config its build command will give it)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..core.errors import PackageError
from ..core.stage import BuildContext, built_from, read_marker
from ..engine.build import check_engine, planned_engine_config
from ..source import files
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
