"""An llmapi repository of the default model, served by the real tritonserver (the nvidia-pytriton
wheel's) on the reference backend, on the device torch finds (CUDA: the FP8 GEMMs on the tensor
cores, torch._scaled_mm, where the GPU is SM 89+): the answers over HTTP, gRPC and a gRPC
stream, and concurrent streams, against the checkpoint runtime's own greedy answers on the same
device, and the time per token.

    python benchmarks/llmapi_serve.py [--gguf SmolLM2-135M-Instruct.Q4_1.gguf] [--dtype fp8]
        [--kv-cache fp8] [--prompts 8] [--tokens 32] [--clients 8] [--report out.json]

Builds `trt-builder build --target llmapi` twice in a temporary directory (a plain repository
and a streaming one; `--gguf`: from that file, as the default model is fetched; else the
embedded default model), serves both, and prints one line per check. Exits 1 when an answer
differs from the runtime's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Three things to pack for a hike:",
    "Once upon a time, in a small village,",
    "The chemical symbol for gold is",
    "import numpy as np\n\n",
    "A haiku about the sea:",
    "The quick brown fox",
    "SELECT name FROM users WHERE",
    "Water boils at",
    "The first law of thermodynamics states",
    "My favourite programming language is",
]


def _build(args: argparse.Namespace, root: Path, streaming: bool) -> Any:
    from trt_builder.pipeline import run
    from trt_builder.spec.build import make_spec

    spec = {"target": "llmapi", "dtype": args.dtype, "kv_cache": args.kv_cache,
            "out": root / "engines", "triton_root": root / ("s" if streaming else "p"),
            "triton.streaming": streaming}  # fmt: skip
    if args.gguf:
        spec["model"] = str(args.gguf.resolve())
    started = time.perf_counter()
    result = run(make_spec(**spec))
    seconds = time.perf_counter() - started
    stages = {r.name: (r.status, round(r.seconds, 1)) for r in result.records}
    print(f"build (streaming={streaming}): {seconds:.1f} s, {stages}", flush=True)
    return result


def main() -> int:
    import torch
    from transformers import AutoTokenizer

    from trt_builder.runtimes.checkpoint import CheckpointRuntime
    from trt_builder.runtimes.fp8 import fp8_kernel_runs
    from trt_builder.triton import client
    from trt_builder.triton.server import start

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--dtype", default="fp8")
    parser.add_argument("--kv-cache", default="fp8")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--report", type=Path)
    parser.add_argument(
        "--no-http",
        action="store_true",
        help="gRPC only (tritonclient's HTTP client needs geventhttpclient)",
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                              "torch": torch.__version__}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="llmapi-serve-") as tmp:
        root = Path(tmp)
        plain, streaming = _build(args, root, False), _build(args, root, True)
        verify = next(r for r in plain.records if r.name == "verify").details
        report["verify"] = {
            k: verify.get(k) for k in ("passed", "top1", "kl_mean", "ppl_delta_pct", "device")
        }
        checkpoint = plain.layout.checkpoint
        runtime = CheckpointRuntime.load(checkpoint, device)
        fp8 = [n for n, w in runtime.w.items() if w.dtype == torch.float8_e4m3fn]
        report["fp8_gemms_on_tensor_cores"] = bool(fp8) and fp8_kernel_runs(
            runtime.w[fp8[0]].device
        )
        print(f"checkpoint runtime on {device}: {len(fp8)} FP8 weights, tensor cores: "
              f"{report['fp8_gemms_on_tensor_cores']}", flush=True)  # fmt: skip
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        end = {int(json.loads((checkpoint / "generation_config.json").read_text())["eos_token_id"])}
        prompts = (PROMPTS * 4)[: args.prompts]
        want, started = {}, time.perf_counter()
        for text in prompts:
            new = runtime.greedy(tokenizer(text).input_ids, args.tokens, end)
            want[text] = tokenizer.decode(new, skip_special_tokens=True)
        report["runtime_s"] = round(time.perf_counter() - started, 2)
        logs = root / "logs"
        logs.mkdir()
        with (
            start(plain.layout.triton, http_port=18000, grpc_port=18001, metrics_port=18002,
                  log=logs / "plain.log") as a,
            start(streaming.layout.triton, http_port=18010, grpc_port=18011, metrics_port=18012,
                  log=logs / "streaming.log") as b,
        ):  # fmt: skip
            ok = True
            for name, ask in (
                ("http", lambda t: client.generate(a.http_url, client.Request(prompt=t, max_tokens=args.tokens))),
                ("grpc", lambda t: client.generate(a.grpc_url, client.Request(prompt=t, max_tokens=args.tokens))),
                ("grpc stream", lambda t: "".join(client.stream(b.grpc_url, client.Request(prompt=t, max_tokens=args.tokens)))),
            ):  # fmt: skip
                if name == "http" and args.no_http:
                    continue
                started = time.perf_counter()
                got = {t: ask(t) for t in prompts}
                seconds = time.perf_counter() - started
                same = sum(got[t] == want[t] for t in prompts)
                ok &= same == len(prompts)
                report[name] = {"same": same, "of": len(prompts), "seconds": round(seconds, 2)}
                print(f"{name}: {same} of {len(prompts)} answers the runtime's, {seconds:.1f} s "
                      f"one at a time", flush=True)  # fmt: skip
            texts = (prompts * args.clients)[: args.clients * 2]
            started = time.perf_counter()
            with ThreadPoolExecutor(args.clients) as pool:
                got_all = list(pool.map(lambda t: "".join(client.stream(
                    b.grpc_url, client.Request(prompt=t, max_tokens=args.tokens))), texts))  # fmt: skip
            seconds = time.perf_counter() - started
            same = sum(g == want[t] for g, t in zip(got_all, texts, strict=True))
            ok &= same == len(texts)
            report["concurrent"] = {"clients": args.clients, "same": same, "of": len(texts),
                                    "seconds": round(seconds, 2)}  # fmt: skip
            print(f"{args.clients} concurrent streams: {same} of {len(texts)} the runtime's, "
                  f"{seconds:.1f} s", flush=True)  # fmt: skip
    report["ok"] = ok
    print(json.dumps(report, indent=2))
    if args.report:
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
