"""What the CLI benchmarks share: the trt-builder executable, and a timed run of it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path


def executable() -> str:
    """The trt-builder of this interpreter's environment."""
    return shutil.which("trt-builder") or str(Path(sys.executable).with_name("trt-builder"))


def timed(argv: list[str], cwd: Path) -> tuple[float, str]:
    """(wall seconds, stdout) of a command; the benchmark stops if it fails."""
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr[-1500:]}")
    return seconds, proc.stdout
