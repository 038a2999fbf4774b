"""What this host has for engines (GPUs, driver, CUDA, TensorRT, TensorRT-LLM, memory, disk) and
which modes it can build engines for; `trt-builder doctor` adds the rest (pipeline/doctor.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from ..core.errors import EngineError
from ..core.versions import tool_version
from ..modes import DOCTOR_ROWS
from ..spec.gpus import FEATURES
from .build import find_toolchain
from .host import gpu_info
from .releases import release_for

#: Build modes, as `--dtype` (and the quantized KV caches), each with the GPU features it needs.
MODES = DOCTOR_ROWS


def cuda_driver_version() -> str | None:
    """The newest CUDA the driver supports (`nvidia-smi --version`)."""
    try:
        out = subprocess.run(["nvidia-smi", "--version"], capture_output=True, text=True,
                             timeout=20, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"CUDA Version\s*:\s*([\d.]+)", out)
    return match.group(1) if match else None


def host_memory_gib() -> float | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    match = re.search(r"MemTotal:\s+(\d+) kB", text)
    return round(int(match.group(1)) / 1024**2, 1) if match else None


def free_disk_gib(path: Path) -> float:
    while not path.exists() and path != path.parent:
        path = path.parent
    return round(shutil.disk_usage(path).free / 1024**3, 1)


def buildable(trtllm: str, trtllm_build: str | None, found: list[dict[str, Any]]) -> dict[str, str]:
    """Per mode, "yes" or "no: why" for this host."""

    if trtllm == "absent" or trtllm_build is None:
        why = "no: TensorRT-LLM is not installed (the NGC container has it)"
        return dict.fromkeys(MODES, why)
    try:
        release_for(trtllm)
    except EngineError as exc:
        return dict.fromkeys(MODES, f"no: {exc}")
    if not found:
        return dict.fromkeys(MODES, "no: no NVIDIA GPU visible")
    sm = min(g["sm"] for g in found)
    answer = {}
    for mode, needs in MODES.items():
        lacking = [FEATURES[need] for need in needs if FEATURES[need].lacks(sm)]
        answer[mode] = f"no: {lacking[0].why.format(sm=sm)}" if lacking else "yes"
    return answer


def inspect(out: Path) -> dict[str, Any]:
    """The host's engine facts, as data; `engine`: per mode, whether an engine builds here."""

    toolchain = find_toolchain()
    found = gpu_info()
    trtllm = tool_version("tensorrt-llm")
    trtllm_build = toolchain.executable if toolchain else None
    return {
        "gpus": found,
        "cuda_driver": cuda_driver_version(),
        "tensorrt": tool_version("tensorrt"),
        "tensorrt_llm": trtllm,
        "trtllm_build": trtllm_build,
        "torch": tool_version("torch"),
        "host_memory_gib": host_memory_gib(),
        "free_disk_gib": free_disk_gib(out),
        "disk_path": str(out),
        "engine": buildable(trtllm, trtllm_build, found),
    }
