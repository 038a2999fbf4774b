"""package: the Triton model repository, validated against Triton's ModelConfig schema."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar

from .. import fetch
from ..errors import PackageError
from ..triton.repository import (
    RepositoryOptions,
    next_version,
    options_from_engine,
    publish,
    write_repository,
)
from .base import BuildContext, built_from, read_marker

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
TOKENIZER_FILES = (*fetch.TOKENIZER_FILES, "config.json")


class PackageStage:
    name: ClassVar[str] = "package"
    version: ClassVar[int] = 2
    tools: ClassVar[tuple[str, ...]] = ("tritonclient", "transformers")
    needs_verified_checkpoint: ClassVar[bool] = True
    code: ClassVar[tuple[str, ...]] = (
        "triton/repository.py",
        "triton/python_models/preprocessing.py",
        "triton/python_models/postprocessing.py",
    )

    def output_dir(self, ctx: BuildContext) -> Path:
        return ctx.layout.triton

    def _engine(self, ctx: BuildContext) -> Path | None:
        """The engine to ship: built (by trt-builder or by hand) from the current checkpoint."""
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
        from ..engine import check_engine

        note = check_engine(engine, digest=ctx.digests.file)  # refuses a changed engine
        if note is not None and note not in ctx.notices:
            ctx.notices.append(note)
        return engine

    def inputs(self, ctx: BuildContext) -> dict[str, Path]:
        found = {
            f"hf/{n}": ctx.layout.hf / n for n in TOKENIZER_FILES if (ctx.layout.hf / n).is_file()
        }
        found["checkpoint/config.json"] = ctx.layout.checkpoint / "config.json"
        engine = self._engine(ctx)
        if engine is not None:
            found["engine"] = engine
        return found

    def engine_config(self, ctx: BuildContext, engine: Path | None) -> dict[str, Any]:
        """The engine's own config.json, or the one the build command will give it."""
        if engine is not None:
            config = json.loads((engine / "config.json").read_text())
        else:
            from ..engine import planned_engine_config

            checkpoint = json.loads((ctx.layout.checkpoint / "config.json").read_text())
            config = planned_engine_config(ctx.spec, checkpoint)
        world = (config.get("pretrained_config", {}).get("mapping") or {}).get("world_size", 1)
        if world != ctx.spec.tp * ctx.spec.pp:
            raise PackageError(
                f"the engine's world size is {world}, the spec's tp x pp is "
                f"{ctx.spec.tp * ctx.spec.pp}: rebuild the engine (trt-builder engine --force)"
            )
        return config

    def options(self, ctx: BuildContext, version: int) -> RepositoryOptions:
        engine = self._engine(ctx)
        triton = ctx.spec.triton
        root = triton.serve_root or str(ctx.layout.triton_root.resolve())
        return options_from_engine(
            self.engine_config(ctx, engine),
            engine_path=f"{root}/{ctx.layout.triton_name}/tensorrt_llm/{version}/engine",
            version=version,
            decoupled=triton.streaming,
            kv_cache_free_gpu_mem_fraction=triton.kv_cache_free_gpu_mem_fraction,
        )

    def params(self, ctx: BuildContext) -> dict[str, Any]:
        # Version 0 stands for whichever version is published next: not part of the key.
        return {"options": asdict(self.options(ctx, version=0))}

    def run(self, ctx: BuildContext, work: Path) -> dict[str, Any]:
        tokenizer = [ctx.layout.hf / n for n in TOKENIZER_FILES if (ctx.layout.hf / n).is_file()]
        engine = self._engine(ctx)
        version = next_version(ctx.layout.triton)
        write_repository(work, self.options(ctx, version), tokenizer, engine)
        return {
            "models": ["ensemble", "preprocessing", "tensorrt_llm", "postprocessing"],
            "version": version,
            "engine_included": engine is not None,
            "note": None if engine else "no engine yet: build it on a GPU host, then rerun package",
        }

    def place(self, ctx: BuildContext, work: Path, link: Path) -> None:
        """Publish `work` as the next version and switch the repository link to it, keeping
        the newest [triton] keep versions."""
        removed = publish(work, link, keep=ctx.spec.triton.keep)
        if removed:
            ctx.notices.append(
                f"removed Triton repository version(s) {removed} (keep {ctx.spec.triton.keep})"
            )
