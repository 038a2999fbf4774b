"""package: the Triton model repository, validated against Triton's ModelConfig schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from .. import fetch
from ..triton.repository import RepositoryOptions, write_repository
from .base import BuildContext

# AutoTokenizer also reads model_type from config.json.
TOKENIZER_FILES = (*fetch.TOKENIZER_FILES, "config.json")


class PackageStage:
    name: ClassVar[str] = "package"
    version: ClassVar[int] = 1
    tools: ClassVar[tuple[str, ...]] = ("tritonclient", "transformers")
    code: ClassVar[tuple[str, ...]] = (
        "triton/repository.py",
        "triton/python_models/preprocessing.py",
        "triton/python_models/postprocessing.py",
    )

    def output_dir(self, ctx: BuildContext) -> Path:
        return ctx.layout.triton

    def _engine(self, ctx: BuildContext) -> Path | None:
        engine = ctx.layout.engine
        # An engine built by trt-builder (stage.json) or by hand with the printed command.
        return engine if (engine / "rank0.engine").is_file() else None

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
