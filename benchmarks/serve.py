"""The reference backend served by a real tritonserver: in-flight batching against one request
at a time, same model, same server, same run.

Builds the embedded SmolLM2-135M-Instruct in float16 with a streaming repository (or uses
--repository), serves it (`trt-builder serve`'s library), then sends the same `--requests`
prompts, each as a user's chat message, over gRPC streams twice: one request at a time, then
`--clients` at once. Prints output tokens/s and the p50/p95 time to first token of each, the
throughput ratio, and how many answers in flight equal the same request's answer alone.

    .venv/bin/python benchmarks/serve.py [--clients 8] [--requests 16] [--tokens 64]
        [--dtype float16] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import atexit
import json
import platform
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _cli import executable, timed  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Write one sentence about the sea.",
    "What is the boiling point of water at sea level?",
    "List three colours.",
    "Explain what a compiler does.",
    "Once upon a time",
    "The quick brown fox",
    "How do plants make food?",
]


def one_request(url: str, prompt: str, tokens: int) -> tuple[float, float, int, str]:
    """(seconds to the first token, seconds in all, tokens, the text) of one streamed ensemble
    request: the
    prompt as a user's chat message, which the repository renders with the model's chat template
    (an instruct model answers raw text with its end token at once, a benchmark of prefills)."""
    import tritonclient.grpc as grpc

    client = grpc.InferenceServerClient(url)
    pieces: queue.Queue = queue.Queue()
    start = time.perf_counter()
    client.start_stream(
        callback=lambda result, error: pieces.put((result, error, time.perf_counter()))
    )

    chat = json.dumps([{"role": "user", "content": prompt}])
    text = grpc.InferInput("messages", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[chat.encode()]], dtype=object))
    limit = grpc.InferInput("max_tokens", [1, 1], "INT32")
    limit.set_data_from_numpy(np.array([[tokens]], dtype=np.int32))
    stream = grpc.InferInput("stream", [1, 1], "BOOL")
    stream.set_data_from_numpy(np.array([[True]]))
    inputs = [text, limit, stream]
    client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
    first, count, text = None, 0, []
    while True:
        result, error, at = pieces.get(timeout=600)
        if error is not None:
            raise RuntimeError(error)
        piece = result.as_numpy("text_output")
        if piece is not None:
            count += 1
            text.append(piece.reshape(-1)[0].decode(errors="replace"))
            first = first if first is not None else at - start
        final = result.get_response().parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            break
    client.stop_stream()
    return float(first or 0.0), time.perf_counter() - start, count, "".join(text)


def run(url: str, prompts: list[str], tokens: int, clients: int) -> dict[str, Any]:
    """Send every prompt, `clients` at a time; the figures, and the answers in prompt order."""
    todo: queue.Queue = queue.Queue()
    for i, p in enumerate(prompts):
        todo.put((i, p))
    results: list[tuple[float, float, int, str]] = []
    answers: dict[int, str] = {}
    lock = threading.Lock()

    def worker() -> None:
        while True:
            try:
                i, prompt = todo.get_nowait()
            except queue.Empty:
                return
            out = one_request(url, prompt, tokens)
            with lock:
                results.append(out)
                answers[i] = out[3]

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttft = sorted(r[0] for r in results)
    total = sum(r[2] for r in results)
    return {
        "requests": len(results),
        "output_tokens": total,
        "wall_s": wall,
        "tokens_per_s": total / wall,
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p95_s": ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))],
        "answers": [answers[i] for i in range(len(prompts))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repository", type=Path, help="a streaming repository to serve")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--dtype", default="float16", help="what to build: float16, int8, ...")
    args = parser.parse_args()
    from trt_builder.triton.server import start

    work = args.workdir or Path(tempfile.mkdtemp(prefix="trt-builder-serve-bench-"))
    if args.workdir is None:
        atexit.register(shutil.rmtree, work, True)
    work.mkdir(parents=True, exist_ok=True)
    repository = args.repository
    if repository is None:
        config = work / "spec.toml"
        config.write_text("[triton]\nstreaming = true\n")
        seconds, out = timed([executable(), "build", "--dtype", args.dtype, "--config", str(config),
                              "--json"], work)  # fmt: skip
        repository = Path(json.loads(out)["triton_repository"])
        print(f"build ({args.dtype}, streaming repository): {seconds:.1f} s")
    from trt_builder.bench.run import _free_ports  # three distinct ones

    ports = dict(zip(("http_port", "grpc_port", "metrics_port"), _free_ports(3), strict=True))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    print(f"machine: {platform.machine()}, {len(__import__('os').sched_getaffinity(0))} CPUs, "
          f"Python {platform.python_version()}")  # fmt: skip
    with start(repository, log=work / "tritonserver.log", **ports) as server:
        url = server.grpc_url.removeprefix("grpc://")
        run(url, prompts[:2], 4, 2)  # warm-up
        alone = run(url, prompts, args.tokens, 1)
        batched = run(url, prompts, args.tokens, args.clients)
    for name, figures in (
        ("one request at a time", alone),
        (f"{args.clients} clients, in flight", batched),
    ):
        print(f"{name}: {figures['tokens_per_s']:.1f} output tokens/s ({figures['output_tokens']} "
              f"tokens in {figures['wall_s']:.1f} s); time to first token p50 "
              f"{figures['ttft_p50_s']:.2f} s, p95 {figures['ttft_p95_s']:.2f} s")  # fmt: skip
    print(
        f"in-flight / one at a time: {batched['tokens_per_s'] / alone['tokens_per_s']:.2f}x output tokens/s"
    )
    same = sum(a == b for a, b in zip(alone["answers"], batched["answers"], strict=True))
    print(f"answers in flight equal to the same request's alone: {same} of {len(prompts)}")


if __name__ == "__main__":
    main()
