"""`trt-builder plan`: the memory plan of a build from the model's config.json alone, before
anything is fetched or built: a local directory's (no weights needed, none read), a hub model's
(downloaded by itself), a GGUF file's (from its metadata)."""

from __future__ import annotations

from typing import Any

from ..engine.memplan import MemoryPlan, resolve_limits
from ..source.fetch import config_alone
from ..source.hub import resolve_hub_revision
from ..source.resolve import classify
from ..source.twin import twin_of
from ..spec.build import BuildSpec
from .build import refuse_unbuildable


def model_config(spec: BuildSpec, *, offline: bool | None = None) -> dict[str, Any]:
    """The HF config of the spec's model, read alone (a local model's weights are neither read
    nor hashed); refuses an unsupported architecture or a tp/pp it cannot take."""
    kind, ref, _ = classify(spec.model, spec.revision)
    sha = resolve_hub_revision(ref, spec.revision, offline=offline) if kind == "hub" else None
    config = config_alone(kind, ref, sha, offline=offline)
    refuse_unbuildable(config, spec)
    return config


def plan_memory(spec: BuildSpec, *, offline: bool | None = None) -> MemoryPlan:
    """The memory plan of `spec` on its target GPU, with the limits the spec leaves open
    filled in; refuses (SpecError) a spec that does not fit, naming what would. A mode that
    builds the model's padded twin plans the twin's engine."""
    config = model_config(spec, offline=offline)
    twin = twin_of(config, spec.mode, spec.tp)
    _, memory = resolve_limits(spec, config if twin is None else twin.config(config))
    return memory
