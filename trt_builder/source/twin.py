"""pad: the model as a mode that needs wider matrices quantizes it (source/padding.py: its exactly
equivalent padded twin), written beside the fetched one (engines/<model>/<revision>/hf-padN/)
and read by calibrate, recipe and convert in its place; verify still answers against the
fetched model. Runs only where the mode asks for a multiple (Mode.pad_multiple) the model's
widths are not: for every other build the stage is skipped and nothing is copied."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, ClassVar

from ..core.fsio import write_json
from ..core.stage import MARKER, BuildContext, Stage
from .files import TOKENIZER_FILES, read_hf_config
from .padding import Twin


def twin_of(config: dict[str, Any], mode: Any, tp: int) -> Twin | None:
    """The twin `mode` (a modes.Mode) builds the model of Hugging Face `config` through at
    `tp`, or None; SpecError where it needs one the model has not (before any work)."""
    multiple = mode.pad_multiple(tp)
    return Twin.of(config, multiple, f"--dtype {mode.base_name}") if multiple else None


def build_twin(ctx: BuildContext) -> Twin | None:
    """This build's twin (None: the fetched model is quantized as it is, or not fetched yet)."""
    if not (ctx.layout.hf / "config.json").is_file():
        return None
    return twin_of(read_hf_config(ctx.layout.hf), ctx.spec.mode, ctx.spec.tp)


def quantized_source(ctx: BuildContext) -> Path:
    """The Hugging Face directory calibrate, recipe and convert read: the twin's, else fetch's."""
    twin = build_twin(ctx)
    return ctx.layout.hf if twin is None else ctx.layout.model_dir / f"hf-{twin.slug}"


def calibration_dir(ctx: BuildContext) -> Path:
    """Where this build's calibration is: one per settings, and per twin."""
    twin = build_twin(ctx)
    slug = ctx.spec.calibrate.slug()
    return ctx.layout.calibration(slug if twin is None else f"{slug}-{twin.slug}")


def source_inputs(hf: Path, label: str = "hf") -> dict[str, Path]:
    """Every file of the Hugging Face directory `hf` (its config.json alone while it is not
    there), as a stage's inputs."""
    inputs = {f"{label}/config.json": hf / "config.json"}
    if hf.is_dir():
        inputs.update({f"{label}/{p.name}": p for p in sorted(hf.iterdir())
                       if p.is_file() and p.name != MARKER})  # fmt: skip
    return inputs


def write_twin(hf: Path, out: Path, twin: Twin) -> dict[str, Any]:
    """The twin of the Hugging Face directory `hf`, in `out`: config.json, one safetensors file
    of the padded tensors, and the tokenizer's files as they are."""
    import torch  # noqa: F401  (safetensors' torch API)
    from safetensors.torch import save_file

    from ..checkpoint.safetensors_io import SafetensorsIndex
    from ..checkpoint.weights import weight_files

    config = read_hf_config(hf)
    with SafetensorsIndex(weight_files(hf)) as index:
        tensors = {name: twin.tensor(name, index.read(name)) for name in index.names()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_json(out / "config.json", twin.config(config))
    for name in TOKENIZER_FILES:
        if (hf / name).is_file():
            shutil.copy2(hf / name, out / name)
    return {"twin": twin.to_json(), "tensors": len(tensors)}


class PadStage(Stage):
    name: ClassVar[str] = "pad"
    version: ClassVar[int] = 1
    tools: ClassVar[tuple[str, ...]] = ("torch", "safetensors")

    def wanted(self, ctx: BuildContext, *, explicit: bool) -> bool:
        return build_twin(ctx) is not None

    def output_dir(self, ctx: BuildContext) -> Path:
        return quantized_source(ctx)

    def inputs(self, ctx: BuildContext) -> dict[str, Path]:
        return source_inputs(ctx.layout.hf)

    def params(self, ctx: BuildContext) -> dict[str, Any]:
        twin = build_twin(ctx)
        return {} if twin is None else twin.to_json()

    def run(self, ctx: BuildContext, work: Path) -> dict[str, Any]:
        twin = build_twin(ctx)
        assert twin is not None  # wanted() runs it only then
        return write_twin(ctx.layout.hf, work, twin)
