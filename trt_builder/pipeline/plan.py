"""`trt-builder plan`: the memory plan of a build from the model's config.json alone (a hub
model's is downloaded by itself, a local directory needs no weights, a GGUF file's comes from
its metadata), before anything is fetched or built."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..engine.memplan import MemoryPlan, resolve_limits
from ..source import hub
from ..source.fetch import gguf_config
from ..source.files import read_hf_config
from ..spec.build import BuildSpec
from .build import prepare


def model_config(spec: BuildSpec, *, offline: bool | None = None) -> dict[str, Any]:
    """The HF config of the spec's model: fetch's copy when there is one, else the config
    alone from the source."""
    ctx = prepare(spec, offline=offline)
    if (ctx.layout.hf / "config.json").is_file():
        return read_hf_config(ctx.layout.hf)
    source = ctx.source
    if source.kind == "local":
        return read_hf_config(Path(source.ref))
    if source.kind == "hub":
        return read_hf_config(hub.config_dir(source.ref, source.revision, offline=offline))
    return gguf_config(Path(source.ref))


def plan_memory(spec: BuildSpec, *, offline: bool | None = None) -> MemoryPlan:
    """The memory plan of `spec` on its target GPU, with the limits the spec leaves open
    filled in; refuses (SpecError) a spec that does not fit, naming what would."""
    _, memory = resolve_limits(spec, model_config(spec, offline=offline))
    return memory
