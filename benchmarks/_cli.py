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


def timed(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[float, str]:
    """(wall seconds, stdout) of a command; the benchmark stops if it fails."""
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False, env=env)
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


#: Llama-2-7B's shape, for the GPU build benchmarks.
LLAMA2_7B = {
    "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "architectures": ["LlamaForCausalLM"],
}  # fmt: skip
GIB = 1 << 30


def gpu_build_args(doc: str | None, dtypes: tuple[str, ...] = ()) -> Any:
    """The GPU build benchmarks' arguments (--tokenizer, --layers, --work, --report, and
    --dtype where `dtypes` names the choices, the first the default); exits where there is no
    CUDA GPU."""
    import argparse

    import torch

    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--work", type=Path, default=Path("/tmp/int8-build-gpu"))
    parser.add_argument("--report", type=Path, help="Also write the figures here (JSON).")
    if dtypes:
        parser.add_argument("--dtype", choices=dtypes, default=dtypes[0])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    return args


def gpu_build(work: Path, tokenizer: Path, layers: int, argv: list[str]) -> dict[str, Any]:
    """`trt-builder build --model <synthetic 7B shape> ARGV --device cuda` as a user runs it, a
    first build in a child process (the model written once under `work`): the wall time, the
    import cost of a fresh process, each stage's status, seconds and peak GPU memory, and the
    verify report's time by part."""
    import json
    import os

    model_dir = work / "model"
    if not (model_dir / "config.json").is_file():
        start = time.perf_counter()
        synthetic_llama(model_dir, tokenizer, {**LLAMA2_7B, "num_hidden_layers": layers}, "cuda")
        import torch

        torch.cuda.empty_cache()  # the model made here is gone: its memory goes to the build
        print(f"wrote the synthetic model in {time.perf_counter() - start:.1f} s", flush=True)
    out = work / "engines"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(work / "triton", ignore_errors=True)
    exe = shutil.which("trt-builder")
    cli = [exe] if exe else [sys.executable, "-m", "trt_builder.cli.main"]  # not installed
    command = [*cli, "build", "--model", str(model_dir), *argv, "--device", "cuda",
               "--out", str(out), "--triton-root", str(work / "triton"), "--json",
               # random weights give near-flat logits: top-1 agreement means nothing there
               "--min-top1", "0", "--max-kl", "1000", "--max-ppl-delta", "1000"]  # fmt: skip
    # what a fresh process pays to import torch and transformers' Llama (the build's first
    # stage that needs them pays it too)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, transformers.models.llama.modeling_llama"],
                   check=True, env=os.environ)  # fmt: skip
    import_s = time.perf_counter() - start
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=os.environ)
    build_s = time.perf_counter() - start
    if proc.returncode != 0:
        print(proc.stdout[-6000:], proc.stderr[-4000:])
        sys.exit(f"the build failed (exit {proc.returncode})")
    result = json.loads(proc.stdout)
    stages = {s["name"]: s for s in result["stages"]}
    steps = {
        name: {
            "status": s["status"],
            "seconds": round(s["seconds"], 2),
            "peak_gpu_gib": round(s["details"]["peak_gpu_bytes"] / GIB, 2)
            if s["details"].get("peak_gpu_bytes")
            else None,
        }
        for name, s in stages.items()
    }
    report = json.loads((Path(result["variant_dir"]) / "reports" / "verify.json").read_text())
    return {
        "build_wall_s": round(build_s, 2),
        "import_torch_transformers_s": round(import_s, 2),
        "steps": steps,
        "verify_by_part": report.get("seconds_by_part"),
        "stages": stages,
        "model_dir": model_dir,
    }
