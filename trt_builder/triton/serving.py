"""`trt-builder serve` as a library call: a real tritonserver on a repository until SIGTERM or
Ctrl-C, restarted by its supervisor when it dies and reloaded when `package` publishes a new
version, then stopped with its whole process group."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.errors import TritonError
from .repository import INFO, REFERENCE
from .serve import EXIT_TIMEOUT_S
from .server import Supervisor, start


def serve_until_stopped(
    repository: Path,
    *,
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    timeout: float = 300.0,
    say: Callable[[str], None] = print,
) -> str:
    """Serve `repository` until SIGTERM or Ctrl-C (`say`: each line to tell meanwhile); how it
    stopped, as one line. TritonError where the stop cut requests off or had to kill it."""

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # also while it starts: start() stops what it began
    supervisor = None
    server = start(repository, http_port=http_port, grpc_port=grpc_port,
                   metrics_port=metrics_port, timeout=timeout)  # fmt: skip
    try:  # from here on, whatever happens, the server is stopped before serve returns
        try:
            info = json.loads((repository / INFO).read_text())
        except (OSError, ValueError):
            info = {}
        what = REFERENCE if info.get("backend") == "reference" else "TensorRT-LLM engine"
        say(f"serving {repository} on {server.http_url} and {server.grpc_url} (tensorrt_llm: "
            f"{what}; tritonserver from {server.binary.source}, log: {server.log}); Ctrl-C "
            "stops it")  # fmt: skip
        supervisor = Supervisor(server, timeout=timeout, say=say)
        supervisor.run()
    except KeyboardInterrupt:
        pass
    finally:
        if supervisor is not None:
            server = supervisor.server  # the one serving now, after any restarts
        code = server.stop()
    if server.left:  # the group is waited for: what outlived the server is named, then killed
        say(f"killed what tritonserver left running after it exited: {', '.join(server.left)}")
    if supervisor is not None and supervisor.restarting:  # stopped while a new one started
        return "tritonserver stopped (during a restart)"
    if server.killed:  # a supervisor should know the drain did not finish
        raise TritonError(f"tritonserver did not stop within 30 s of SIGTERM and was killed "
                          f"(log: {server.log})")  # fmt: skip
    if code != 0:  # Triton's own: requests still in flight when its exit timeout passed
        raise TritonError(f"tritonserver stopped with exit {code}: requests in flight "
                          f"{EXIT_TIMEOUT_S} s after the stop were cut off (log: {server.log})")  # fmt: skip
    return f"tritonserver stopped (exit {code})"
