"""Data-center GPUs a build can target: memory and compute capability (SM)."""

from __future__ import annotations

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
