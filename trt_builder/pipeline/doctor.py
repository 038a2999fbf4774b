"""`trt-builder doctor`: what this host has, and per mode what it can do here: build the
checkpoint, verify and the Triton repository (wherever torch runs), build the engine (TensorRT-LLM
and a GPU that takes the mode), and serve (which tritonserver, and which backend it would run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..engine.doctor import inspect as inspect_engine
from ..targets import ROOMS as TARGETS
from ..triton.server import NGC, Binary, find_tritonserver


def building(engine: str) -> str:
    """What `build` makes of a mode here: every stage runs wherever torch does, the engine only
    where `engine` says yes."""
    if engine == "yes":
        return "yes: every stage, the engine included"
    return "yes: every stage but the engine (whose trtllm-build command it prints)"


def serving(engine: str, binary: Binary | None) -> str:
    """How a build of a mode whose engine answer is `engine` would be served by `binary`."""
    if binary is None:
        return "no: no tritonserver (pip install 'trt-builder[serve]', or the NGC container)"
    backends = binary.backends or NGC.parent.parent / "backends"  # the server's default
    if engine == "yes" and (backends / "tensorrtllm").is_dir():
        return "yes: the engine, on NVIDIA's TensorRT-LLM backend"
    return "yes: the checkpoint, on the reference backend (a PyTorch reference, not TensorRT-LLM)"


def inspect(out: Path) -> dict[str, Any]:
    """Everything `doctor` reports, as data: the host (engine/doctor.py) and `modes`, per mode
    {"build", "engine", "serve"}, each "yes: ..." or "no: why"."""
    report = inspect_engine(out)
    binary = find_tritonserver()
    report["tritonserver"] = str(binary.executable) if binary else None
    report["modes"] = {
        mode: {"build": building(engine), "engine": engine, "serve": serving(engine, binary)}
        for mode, engine in report["engine"].items()
    }
    report["targets"] = {
        target.name: {"makes": target.MAKES, "here": target.here(report, tritonserver=bool(binary))}
        for target in TARGETS
    }
    return report
