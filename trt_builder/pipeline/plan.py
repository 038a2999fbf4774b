"""`trt-builder plan`: the memory plan of a build from the model's config.json alone, before
anything is fetched or built: a local directory's (no weights needed, none read), a hub model's
(downloaded by itself), a GGUF file's (from its metadata)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..checkpoint.mapping import check_mapping
from ..engine.memplan import MemoryPlan, resolve_limits
from ..models.registry import family_for
from ..source import hub
from ..source.fetch import gguf_config
from ..source.files import read_hf_config
from ..source.resolve import classify
from ..spec.build import BuildSpec


def model_config(spec: BuildSpec, *, offline: bool | None = None) -> dict[str, Any]:
    """The HF config of the spec's model, read alone (a local model's weights are neither read
    nor hashed); refuses an unsupported architecture or a tp/pp it cannot take."""
    kind, ref, _ = classify(spec.model, spec.revision)
    if kind == "local":
        config = read_hf_config(Path(ref))
    elif kind == "hub":
        sha = hub.resolve_hub_revision(ref, spec.revision, offline=offline)
        config = read_hf_config(hub.config_dir(ref, sha, offline=offline))
    else:
        config = gguf_config(Path(ref))
    family = family_for(config)
    if spec.tp * spec.pp > 1:
        check_mapping(family.config(config), spec.tp, spec.pp)
    return config


def plan_memory(spec: BuildSpec, *, offline: bool | None = None) -> MemoryPlan:
    """The memory plan of `spec` on its target GPU, with the limits the spec leaves open
    filled in; refuses (SpecError) a spec that does not fit, naming what would."""
    _, memory = resolve_limits(spec, model_config(spec, offline=offline))
    return memory
