"""What clients see when serving goes wrong: `trt-builder serve` (a real tritonserver) of the
default model's int8 repository, streaming and plain, under the faults of docs/triton.md's table,
each timed from the fault, with the clients and probes tests/test_serve.py asserts with.

    .venv/bin/python benchmarks/serve_faults.py [--workdir DIR] [--tokens 1000]

Builds `trt-builder build --dtype int8` twice in the work directory (a streaming repository
and a plain one; the second reuses the first's stages up to package), then, against serve:
- SIGKILL to the tensorrt_llm model's model process with a request in flight on each protocol
  (through the ensemble: HTTP, HTTP stream, a streamed and a whole answer over gRPC streams;
  straight to tensorrt_llm over a gRPC stream);
- SIGKILL to the tensorrt_llm stub with streams through the ensemble and one straight to it;
- 10 HTTP streams closed, then 10 gRPC streams cancelled, after their first piece: how long the
  model process goes on computing; then SIGTERM: serve's exit code, its time, what is left;
- on the plain repository, an HTTP client of the ensemble that leaves mid-request, and a
  gRPC call whose deadline passes.
Prints one line per client and per measure.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _cli import executable, timed  # noqa: E402
from test_serve import _Call, _computing_for, _Serve  # noqa: E402


def build(workdir: Path, streaming: bool) -> Path:
    """The default model's int8 repository, streaming or plain: its directory."""
    spec = workdir / f"{'streaming' if streaming else 'plain'}.toml"
    spec.write_text(f"[triton]\nstreaming = {str(streaming).lower()}\n")
    root = workdir / ("triton-streaming" if streaming else "triton-plain")
    seconds, out = timed([executable(), "build", "--dtype", "int8", "--config", str(spec),
                          "--triton-root", str(root), "--json"], workdir)  # fmt: skip
    import json

    repository = Path(json.loads(out)["triton_repository"])
    print(f"built {repository.name} ({'streaming' if streaming else 'plain'}) in {seconds:.0f} s")
    return repository


def report(calls: list[_Call], since: float, wait: float = 30.0) -> None:
    for call in calls:
        outcome = call.join(wait)
        took = f"{call.ended - since:5.2f} s" if call.ended else "   --  "
        print(f"  {call.how:18s} {call.model:13s} {took}  {outcome[:150]}")


def until(condition: Any, seconds: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if condition():
            return time.monotonic() - start
        time.sleep(0.1)
    return None


def computing_after(worker: int, since: float) -> str:
    try:
        return f"within {_computing_for(worker, since, limit=60):.1f} s"
    except AssertionError:
        return "not within 60 s"


def deaths(serve: _Serve, tokens: int) -> None:
    ways = ["http", "http-stream", "grpc-stream", "grpc-stream-whole"]
    calls = [_Call(serve.ports, how, tokens=tokens) for how in ways]
    calls.append(_Call(serve.ports, "direct", "tensorrt_llm", tokens=tokens))
    for call in calls:
        call.first.wait(60)
    time.sleep(1.0)
    worker = serve.model_process()
    killed = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    print(f"SIGKILL to the model process (pid {worker}), {len(calls)} requests in flight:")
    report(calls, killed)
    down = until(lambda: not serve.ready(), 10)
    back = serve.serving(times=2)
    print(f"  readiness false after {down:.2f} s; serving again {time.monotonic() - killed:.1f} s "
          f"after the kill; serve said: {[ln for ln in serve.lines if 'restart' in ln][-1]}")  # fmt: skip
    del back
    calls = [_Call(serve.ports, how, tokens=tokens) for how in ("http-stream", "grpc-stream")]
    calls.append(_Call(serve.ports, "direct", "tensorrt_llm", tokens=tokens))
    for call in calls:
        call.first.wait(60)
    stub, _ = serve.stub()
    killed = time.monotonic()
    os.kill(stub, signal.SIGKILL)
    print(f"SIGKILL to the tensorrt_llm stub (pid {stub}), {len(calls)} streams in flight:")
    report(calls, killed)
    serve.serving(times=3)
    print(f"  serving again {time.monotonic() - killed:.1f} s after the kill")


def departures(serve: _Serve, tokens: int) -> None:
    group, worker = serve.triton(), serve.model_process()
    for how in ("http-stream", "grpc-stream"):
        calls = [_Call(serve.ports, how, tokens=tokens, leave=True) for _ in range(10)]
        outcomes = [call.join(120) for call in calls]
        left = max(call.ended for call in calls)
        print(f"10 {how} clients to the ensemble gone after their first piece ({set(outcomes)}): "
              f"the model process stopped computing {computing_after(worker, left)} of "
              "the last one's departure")  # fmt: skip
    asked = time.monotonic()
    code = serve.stop()
    print(f"SIGTERM: serve exited {code} after {time.monotonic() - asked:.1f} s; processes of its "
          f"server's group left: {serve.group(group) or 'none'}; killed by serve: "
          f"{[ln for ln in serve.lines if 'killed what' in ln] or 'none'}")  # fmt: skip


def plain_departure(serve: _Serve, tokens: int) -> None:
    import http.client
    import json

    import tritonclient.grpc as grpc
    from test_serve import _ensemble_body, _ensemble_inputs

    worker = serve.model_process()  # the gRPC call first: the HTTP one runs to its end
    client = grpc.InferenceServerClient(f"127.0.0.1:{serve.ports['grpc_port']}")
    inputs = _ensemble_inputs(grpc, tokens, False)
    try:
        client.infer("ensemble", inputs, client_timeout=1)
    except grpc.InferenceServerException as exc:
        print(f"plain repository: a gRPC call to the ensemble with a 1 s deadline ({exc.status()}): "
              f"the model process stopped computing {computing_after(worker, time.monotonic())} "
              "of the deadline")  # fmt: skip
    connection = http.client.HTTPConnection("127.0.0.1", serve.ports["http_port"], timeout=1)
    connection.request("POST", "/v2/models/ensemble/generate",
                       json.dumps(_ensemble_body(tokens, False)))  # fmt: skip
    try:
        connection.getresponse()
    except TimeoutError:
        connection.close()
    print(f"plain repository: an HTTP client of the ensemble's /generate gone after 1 s ({tokens} "
          f"tokens asked): the model process stopped computing "
          f"{computing_after(worker, time.monotonic())} of its departure")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, help="where to build (default: a temporary one)")
    parser.add_argument("--tokens", type=int, default=1000, help="tokens each request asks for")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="serve-faults-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}")
    streaming, plain = build(workdir, True), build(workdir, False)
    runs = [("streaming-deaths", streaming, deaths), ("streaming-departures", streaming, departures),
            ("plain-departure", plain, plain_departure)]  # fmt: skip
    for name, repository, run in runs:  # each on a server of its own, under serve
        (workdir / name).mkdir(exist_ok=True)
        serve = _Serve(repository, workdir / name)
        try:
            serve.serving()
            run(serve, args.tokens)
        finally:
            serve.stop()
    if args.workdir is None:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
