"""calibrate: activation statistics of the HF model over a calibration set, shared by every
variant of the model (engines/<model>/<revision>/calibration/<settings>/)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from ..core.stage import BuildContext, Stage
from ..source.twin import calibration_dir, quantized_source, source_inputs


class CalibrateStage(Stage):
    name: ClassVar[str] = "calibrate"
    version: ClassVar[int] = 1
    tools: ClassVar[tuple[str, ...]] = ("torch", "transformers")

    def wanted(self, ctx: BuildContext, *, explicit: bool) -> bool:
        """Asked for by name, or needed by the mode (SmoothQuant, the INT8 KV cache)."""
        return explicit or ctx.spec.mode.needs_calibration

    def output_dir(self, ctx: BuildContext) -> Path:
        return calibration_dir(ctx)

    def inputs(self, ctx: BuildContext) -> dict[str, Path]:
        # the weights, config and tokenizer decide the statistics (the padded twin's, where
        # the mode builds one: source/twin.py)
        inputs = source_inputs(quantized_source(ctx))
        dataset = ctx.spec.calibrate.dataset
        if Path(dataset).is_file():
            inputs["dataset"] = Path(dataset)
        return inputs

    def params(self, ctx: BuildContext) -> dict[str, Any]:
        return ctx.spec.calibrate.key_fields()

    def run(self, ctx: BuildContext, work: Path) -> dict[str, Any]:
        from .stats import calibrate  # torch and transformers: only when it runs

        return calibrate(quantized_source(ctx), work, ctx.spec.calibrate)
