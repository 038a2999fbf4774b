"""Versions of the tools a stage's output depends on (part of every cache key)."""

from __future__ import annotations

import importlib.metadata
from functools import cache

from .. import __version__

_DISTRIBUTIONS = {
    "torch": "torch",
    "transformers": "transformers",
    "safetensors": "safetensors",
    "gguf": "gguf",
    "huggingface-hub": "huggingface-hub",
    "tritonclient": "tritonclient",
    "tensorrt-llm": "tensorrt_llm",
    "tensorrt": "tensorrt",
}


@cache
def tool_version(name: str) -> str:
    """Installed version of a tool, or "absent"."""
    if name == "trt-builder":
        return __version__
    try:
        return importlib.metadata.version(_DISTRIBUTIONS.get(name, name))
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def tool_versions(names: tuple[str, ...]) -> dict[str, str]:
    return {name: tool_version(name) for name in ("trt-builder", *names)}
