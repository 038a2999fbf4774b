"""What the benchmarks share: the trt-builder executable, a timed run of it, and the held-out
text the INT8 benchmarks score on."""

from __future__ import annotations

import atexit
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


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


def held_out(hf: Path | None, tokens: int, prefix: str) -> tuple[Path, Path, Any]:
    """(work directory, model directory, token windows): a work directory removed at exit
    (checkpoints of GBs are never left behind); the model, the default one fetched into it
    unless `hf` names one; `tokens` of the held-out corpus as a tensor of windows."""
    import torch
    from transformers import AutoTokenizer

    from trt_builder.calibrate.corpus import corpus_windows

    work = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, work, True)
    if hf is None:
        from trt_builder.pipeline.build import run
        from trt_builder.spec.build import make_spec

        hf = Path(run(make_spec(out=work / "engines"), only=("fetch",)).layout.hf)
    return work, hf, torch.tensor(corpus_windows(AutoTokenizer.from_pretrained(hf), tokens))
