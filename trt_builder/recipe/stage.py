"""recipe: SmoothQuant's alphas searched on held-apart text, in memory (search.py), for a mode
whose alpha is `auto`. Keyed by the model's weights, the calibration, the search split, the
candidate set and the search's own code: editing the converter reruns convert alone, and a
recipe that comes out the same does not rerun convert."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, ClassVar

from ..calibrate import MODEL_HANDOFF
from ..core.fsio import write_json
from ..core.stage import BuildContext
from .candidates import SearchSet, recipe_dir, searches

SEARCH_SPLIT = Path(__file__).parents[1] / "calibrate" / "data" / "search.jsonl"


class RecipeStage:
    name: ClassVar[str] = "recipe"
    version: ClassVar[int] = 1
    tools: ClassVar[tuple[str, ...]] = ("torch", "transformers")
    takes: ClassVar[tuple[str, ...]] = (MODEL_HANDOFF,)  # the model calibrate loaded

    def wanted(self, ctx: BuildContext, *, explicit: bool) -> bool:
        return searches(ctx)

    def output_dir(self, ctx: BuildContext) -> Path:
        return recipe_dir(ctx)

    def _calibration(self, ctx: BuildContext) -> Path:
        return ctx.layout.calibration(ctx.spec.calibrate.slug())

    def inputs(self, ctx: BuildContext) -> dict[str, Path]:
        hf = ctx.layout.hf  # the float model it simulates: config, weights, tokenizer
        inputs = {"hf": hf, "calibration": self._calibration(ctx) / "calibration.safetensors"}
        inputs["search split"] = SEARCH_SPLIT
        return inputs

    def _choice(self, ctx: BuildContext) -> SearchSet:
        return SearchSet(per_token=bool(getattr(ctx.spec.mode, "per_token", True)))

    def params(self, ctx: BuildContext) -> dict[str, Any]:
        return self._choice(ctx).key_fields()

    def run(self, ctx: BuildContext, work: Path) -> dict[str, Any]:
        from .search import search  # torch and transformers: only when it runs

        options = ctx.spec.calibrate
        try:
            recipe = search(ctx.layout.hf, self._calibration(ctx), self._choice(ctx),
                            device=options.device, batch=options.batch_size,
                            offload=work / "offload", progress=ctx.progress,
                            handoff=ctx.handoff)  # fmt: skip
        finally:
            shutil.rmtree(work / "offload", ignore_errors=True)
        write_json(work / "recipe.json", recipe)
        keys = ("chosen", "alpha", "tokens", "device", "seconds", "peak_gpu_bytes")
        return {k: recipe[k] for k in keys}
