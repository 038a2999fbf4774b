"""Looking a family up: every module of this package except the framework ones is a family
module, loaded by name, so adding a family is adding one module (docs/adding-a-model.md)."""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from pathlib import Path
from typing import Any

from ..core.errors import ConversionError, UnsupportedModelError
from .family import REGISTRY, Family

#: This package's modules that are not families.
FRAMEWORK = ("family", "registry", "shape")


@cache
def load_all() -> dict[str, Family]:
    """Import every family module (each registers itself); the registry by architecture."""
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name not in FRAMEWORK:
            importlib.import_module(f"{__package__}.{info.name}")
    return REGISTRY


def family_of_checkpoint(config: dict[str, Any]) -> Family:
    """The family of a TensorRT-LLM checkpoint config (its `architecture`, which every family
    writes under one of its registered names)."""
    return family_for({"architectures": [config.get("architecture")]})


def family_for(hf_config: dict[str, Any]) -> Family:
    """The family of an HF config, or an error listing what is supported."""
    load_all()
    archs = [str(a) for a in hf_config.get("architectures") or [] if a]
    for arch in archs:
        if arch in REGISTRY:
            return REGISTRY[arch]
    raise UnsupportedModelError(
        f"architecture {', '.join(archs) or '(none in config.json)'} is not supported: "
        f"supported are {', '.join(sorted(REGISTRY))}"
    )


def refuse_mode(family: Family, architecture: str, flag: str | None) -> None:
    """A mode for a family it does not build (`flag`: the mode's Mode.FAMILY_FLAG), refused
    with the way out."""
    if flag == "smoothquant":
        refuse_smoothquant(family, architecture)


def refuse_smoothquant(family: Family, architecture: str) -> None:
    """SmoothQuant for a family it does not build, refused with the way out (early, from the
    config alone, and again by convert)."""
    if not family.smoothquant:
        supported = sorted(a for a, f in load_all().items() if f.smoothquant)
        raise ConversionError(
            f"SmoothQuant is not supported for {architecture} yet: use --dtype int8-wo "
            f"(SmoothQuant supports {', '.join(supported)})"
        )
