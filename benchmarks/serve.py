"""The reference backend served by a real tritonserver: in-flight batching against one request
at a time, same model, same server, same run.

Builds the embedded SmolLM2-135M-Instruct in float16 with a streaming repository (or uses
--repository), serves it (`trt-builder serve`'s library), then sends the same `--requests`
prompts, each as a user's chat message, over gRPC streams twice: one request at a time, then `--clients` at once. Prints
output tokens/s and the p50/p95 time to first token of each, and the throughput ratio.

    .venv/bin/python benchmarks/serve.py [--clients 8] [--requests 16] [--tokens 64] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import atexit
import json
import platform
import queue
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_request(url: str, prompt: str, tokens: int) -> tuple[float, float, int]:
    """(seconds to the first token, seconds in all, tokens) of one streamed ensemble request: the
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
    first, count = None, 0
    while True:
        result, error, at = pieces.get(timeout=600)
        if error is not None:
            raise RuntimeError(error)
        if result.as_numpy("text_output") is not None:
            count += 1
            first = first if first is not None else at - start
        final = result.get_response().parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            break
    client.stop_stream()
    return float(first or 0.0), time.perf_counter() - start, count


def run(url: str, prompts: list[str], tokens: int, clients: int) -> dict[str, float]:
    """Send every prompt, `clients` at a time; the figures."""
    todo: queue.Queue = queue.Queue()
    for p in prompts:
        todo.put(p)
    results: list[tuple[float, float, int]] = []
    lock = threading.Lock()

    def worker() -> None:
        while True:
            try:
                prompt = todo.get_nowait()
            except queue.Empty:
                return
            out = one_request(url, prompt, tokens)
            with lock:
                results.append(out)

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
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repository", type=Path, help="a streaming repository to serve")
    parser.add_argument("--workdir", type=Path)
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
        seconds, out = timed([executable(), "build", "--dtype", "float16", "--config", str(config),
                              "--json"], work)  # fmt: skip
        repository = Path(json.loads(out)["triton_repository"])
        print(f"build (float16, streaming repository): {seconds:.1f} s")
    ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}
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


if __name__ == "__main__":
    main()
