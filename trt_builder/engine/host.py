"""This host's GPUs, as nvidia-smi reports them."""

from __future__ import annotations

import subprocess
from typing import Any


def gpu_info() -> list[dict[str, Any]]:
    """Each GPU of this host (nvidia-smi): name, SM (e.g. 90), memory in MiB, driver; []
    where there is none."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,compute_cap,memory.total,driver_version",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        name, cap, memory, driver = parts
        try:
            found.append({"name": name, "sm": int(cap.replace(".", "")),
                          "memory_mib": int(float(memory)), "driver": driver})  # fmt: skip
        except ValueError:
            continue
    return found


def local_gpus() -> list[str]:
    """The GPUs of this host as "name (SM xy)"; [] where there is none."""
    return [f"{g['name']} (SM {g['sm']})" for g in gpu_info()]
