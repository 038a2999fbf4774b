"""What the benchmarks share: the trt-builder executable, a timed run of it, the held-out text
the INT8 benchmarks score on, and synthetic Llama-shaped models."""

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


def synthetic_llama(out: Path, tokenizer: Path, shape: dict[str, Any], device: str = "cpu") -> None:
    """A LlamaForCausalLM of `shape` (LlamaConfig's keys) with random bfloat16 weights from
    seed 0 and the vocabulary of `tokenizer` (a directory with tokenizer.json), written with
    that tokenizer as a local model directory; made on `device`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer)
    config = LlamaConfig(**shape, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size="2GB")
    tok.save_pretrained(out)
