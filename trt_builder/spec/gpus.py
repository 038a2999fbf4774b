"""Data-center GPUs a build can target: memory and compute capability (SM)."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_gib: float
    sm: int  # compute capability x10, e.g. 90 for Hopper


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("A10G", 24, 86),
        GpuSpec("L4", 24, 89),
        GpuSpec("L40S", 48, 89),
        GpuSpec("A100-40GB", 40, 80),
        GpuSpec("A100-80GB", 80, 80),
        GpuSpec("H100-80GB", 80, 90),
        GpuSpec("H200", 141, 90),
        GpuSpec("B200", 180, 100),
    )
}


@dataclass(frozen=True)
class Feature:
    """What a mode may need of a GPU (Mode.gpu_needs): the SMs that lack it, and why."""

    lacking: Container[int]  # the SMs without it
    why: str  # `doctor`'s reason, formatted with the GPU's {sm}
    instead: str = "target another GPU (doctor lists what each runs)"  # the way out

    def lacks(self, sm: int) -> bool:
        return sm in self.lacking


#: The GPU features modes need, in the order of the GPU generations that brought them.
FEATURES: dict[str, Feature] = {
    "bf16": Feature(range(0, 80), "bfloat16 needs SM 80 or newer, this GPU is SM {sm}"),
    # TensorRT-LLM's builder.py refuses INT8 (weight-only, SmoothQuant, the INT8 KV cache) on
    # the build GPU's SM 100-119
    "int8": Feature(
        range(100, 120), "TensorRT-LLM refuses INT8 and SmoothQuant on SM {sm} (SM 100-119)"
    ),  # fmt: skip
    # no FP8 GEMM kernel below SM 89; TensorRT-LLM's support matrix lists FP8 (the KV cache
    # included) on SM 89 and up only (docs/quantization.md)
    "fp8": Feature(range(0, 89), "FP8 needs SM 89 or newer, this GPU is SM {sm}"),
    # TensorRT-LLM's builder.py refuses INT4 as it refuses INT8 on SM 100-119, and its support
    # matrix lists W4A16 AWQ on Ampere, Ada and Hopper only (docs/quantization.md)
    "int4": Feature(
        frozenset(range(0, 80)) | frozenset(range(100, 120)),
        "TensorRT-LLM builds INT4 weights on SM 80-90 (Ampere, Ada, Hopper), this GPU is SM {sm}",
    ),
    # FP4 tensor cores: Blackwell; TensorRT-LLM's NVFP4 GEMM plugin and FP4Linear need them
    "fp4": Feature(
        range(0, 100),
        "NVFP4 GEMMs need SM 100 or newer (Blackwell: B200), this GPU is SM {sm}",
        "use --target llmapi (its checkpoint runs weight-only through Marlin there), --dtype "
        "int4-awq or fp8, or target a B200",
    ),
}
