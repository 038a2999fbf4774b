"""recipe: what a mode leaves to measured accuracy, searched on held-apart text in memory (each
mode's room registers its search: modes/<mode>/recipe/). Keyed by the model's weights, the
calibration, the search split, the candidate set and the search's own code: editing the
converter reruns convert alone, and a recipe that comes out the same does not rerun convert.
The text the model samples for a search is kept in the model's records (core/records.py), so
the next mode's search of the same model does not sample it again."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, ClassVar

from ..core.fsio import write_json
from ..core.records import Records, model_records
from ..core.rooms import load_rooms
from ..core.stage import BuildContext, Stage
from ..source.twin import calibration_dir, quantized_source
from .candidates import recipe_dir, search_set, searches
from .dispatch import run_search

SEARCH_SPLIT = Path(__file__).parents[1] / "calibrate" / "data" / "search.jsonl"


def _records(ctx: BuildContext) -> Records:
    """The text the searched model (the build's, or its twin) samples on the search's device,
    kept for every search of it (calibrate/corpus.py: sampled_windows)."""
    from ..calibrate.corpus import SAMPLED_FORMAT
    from ..source.hf import pick_device

    device = pick_device(ctx.spec.calibrate.device)
    return model_records(ctx, device, SAMPLED_FORMAT, quantized_source(ctx))


class RecipeStage(Stage):
    name: ClassVar[str] = "recipe"
    version: ClassVar[int] = 1
    tools: ClassVar[tuple[str, ...]] = ("torch", "transformers")

    def wanted(self, ctx: BuildContext, *, explicit: bool) -> bool:
        return searches(ctx)

    def output_dir(self, ctx: BuildContext) -> Path:
        return recipe_dir(ctx)

    def _calibration(self, ctx: BuildContext) -> Path:
        return calibration_dir(ctx)

    def inputs(self, ctx: BuildContext) -> dict[str, Path]:
        hf = quantized_source(ctx)  # the float model it simulates: config, weights, tokenizer
        inputs = {"hf": hf, "calibration": self._calibration(ctx) / "calibration.safetensors"}
        inputs["search split"] = SEARCH_SPLIT
        return inputs

    def params(self, ctx: BuildContext) -> dict[str, Any]:
        choice = search_set(ctx.spec.mode)  # None: asked for by name, not run
        return {} if choice is None else choice.key_fields()

    def run(self, ctx: BuildContext, work: Path) -> dict[str, Any]:
        options = ctx.spec.calibrate
        choice = search_set(ctx.spec.mode)
        assert choice is not None  # wanted() runs it only then
        where: dict[str, Any] = dict(device=options.device, batch=options.batch_size,
                                     offload=work / "offload", progress=ctx.progress,
                                     records=_records(ctx))  # fmt: skip
        load_rooms("modes", "recipe")  # torch and transformers: when it runs
        try:
            recipe, keys = run_search(
                choice, quantized_source(ctx), self._calibration(ctx), work, where
            )
        finally:
            shutil.rmtree(work / "offload", ignore_errors=True)
        write_json(work / "recipe.json", recipe)
        return {
            k: recipe[k] for k in ("chosen", "tokens", "device", "seconds", "peak_gpu_bytes", *keys)
        }
