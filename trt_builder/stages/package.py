"""package: the Triton model repository, validated against Triton's ModelConfig schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

from .. import fetch
from ..triton.repository import RepositoryOptions, write_repository
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
    version: ClassVar[int] = 1
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

    def options(self, ctx: BuildContext) -> RepositoryOptions:
        lim = ctx.spec.limits
        assert lim.max_batch_size is not None  # the pipeline resolved it from the memory plan
        return RepositoryOptions(
            max_batch_size=lim.max_batch_size,
            max_input_len=lim.max_input_len,
            max_beam_width=lim.max_beam_width,
            engine_path=str((ctx.layout.triton / "tensorrt_llm" / "1" / "engine").resolve()),
        )

    def params(self, ctx: BuildContext) -> dict[str, Any]:
        return {"options": self.options(ctx).__dict__}

    def run(self, ctx: BuildContext, work: Path) -> dict[str, Any]:
        tokenizer = [ctx.layout.hf / n for n in TOKENIZER_FILES if (ctx.layout.hf / n).is_file()]
        engine = self._engine(ctx)
        write_repository(work, self.options(ctx), tokenizer, engine)
        return {
            "models": ["ensemble", "preprocessing", "tensorrt_llm", "postprocessing"],
            "engine_included": engine is not None,
            "note": None if engine else "no engine yet: build it on a GPU host, then rerun package",
        }
