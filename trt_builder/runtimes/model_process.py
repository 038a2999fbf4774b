"""The reference backend's model process: the checkpoint runtime and its in-flight batch in a
process of their own, driven by the Triton model (its stub) over a socket pair.

Why a process apart: when the process that holds the model dies (the OOM killer, a fault in a
kernel, a SIGKILL), the requests it was running must hear why. A Triton Python-backend stub that
dies takes its requests with it unanswered (the Python backend never answers a dead stub's
decoupled requests); a model process that dies leaves the stub alive to answer each of its
requests with an error naming the death (ModelProcess.step raises ProcessDied), and to start a
new one for the next request.

Messages, stub to process: ("submit", id, Request), ("cancel", id). Process to stub: ("ready",
{"vocab_size", "device"}) or ("error", message) once loaded; then ("events", [Event, ...]) after
each step, ("failed", [id, ...], message) for a step that raised. The ids are the stub's.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import NoReturn

from .requests import Event, ProcessDied, Request, StepFailed

#: The command line's module: how serve tells a model process from other processes.
MODULE = "trt_builder.runtimes.model_process"
#: Seconds step() waits for the process's next message before it returns (so that the caller
#: can admit and cancel requests meanwhile).
WAIT_S = 0.1


def _python() -> str:
    """The interpreter to start: this one, unless it is embedded (a Triton stub's), then the
    python3 on PATH (serve puts its environment's first)."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    return shutil.which("python3") or "python3"


def _how(code: int | None) -> str:
    if code is None:
        return "closed its connection"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with {code}"


class ModelProcess:
    """InflightBatcher's interface (submit, cancel, idle, step) over a model process: `name`
    names it in messages and on its command line (the Triton model instance's). A process that
    died is started again at the next submit()."""

    def __init__(self, name: str, checkpoint: Path, device: str, max_batch_size: int) -> None:
        self.name, self.checkpoint = name, Path(checkpoint)
        self.device, self.max_batch_size = device, max_batch_size
        self.process: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self.outstanding: set[int] = set()
        self.next_id = 0
        self.vocab_size = 0
        self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        argv = [_python(), "-m", MODULE, self.name, str(theirs.fileno()), str(self.checkpoint),
                self.device, str(self.max_batch_size)]  # fmt: skip
        try:
            self.process = subprocess.Popen(argv, pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            message = ("error", f"model process {self.name} {_how(self.process.wait())} "
                                "while loading the checkpoint (see the server's log)")  # fmt: skip
        if message[0] != "ready":
            self.close()
            raise RuntimeError(message[1])
        self.vocab_size = int(message[1]["vocab_size"])
        self.device = message[1]["device"]

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0

    @property
    def idle(self) -> bool:
        return not self.outstanding

    def submit(self, request: Request) -> int:
        """Queue a request in the process (started again first if it died); its id."""
        if self.process is not None and self.process.poll() is not None and self.idle:
            self.close()  # it died between requests: none was cut off
        if self.conn is None:
            self._start()
        rid, self.next_id = self.next_id, self.next_id + 1
        self.outstanding.add(rid)
        self._send(("submit", rid, request))
        return rid

    def cancel(self, rid: int) -> None:
        if rid in self.outstanding:
            self.outstanding.discard(rid)
            self._send(("cancel", rid))

    def _send(self, message: tuple) -> None:
        try:
            assert self.conn is not None
            self.conn.send(message)
        except (OSError, AssertionError):  # it died: step() says so
            pass

    def step(self) -> list[Event]:
        """The events of the process's next step (none if it sends none within WAIT_S); a
        cancelled request's are dropped. StepFailed for a step that raised, ProcessDied, with
        every request it held, if the process died."""
        assert self.conn is not None
        try:
            if not self.conn.poll(WAIT_S):
                return []
            message = self.conn.recv()
        except (EOFError, OSError):
            self._died()
        if message[0] == "failed":
            failed = [rid for rid in message[1] if rid in self.outstanding]
            self.outstanding.difference_update(failed)
            raise StepFailed(failed, message[2])
        events = [e for e in message[1] if e.request in self.outstanding]
        self.outstanding.difference_update(e.request for e in events if e.finished)
        return events

    def _died(self) -> NoReturn:
        assert self.process is not None
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # its connection broke, not the process: end it
            self.process.kill()
            code = self.process.wait()
        pid, failed = self.process.pid, sorted(self.outstanding)
        self.close()
        raise ProcessDied(failed, f"model process {self.name} (PyTorch, pid {pid}) {_how(code)}: "
                                  "this request was cut off; send it again")  # fmt: skip

    def close(self) -> None:
        """End the process (its connection closed, it exits; killed if it does not)."""
        self.outstanding.clear()
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.process is not None and self.process.poll() is None:
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _serve(conn: Connection, checkpoint: Path, device: str, max_batch_size: int) -> None:
    import torch

    from .batching import InflightBatcher
    from .checkpoint import CheckpointRuntime

    try:
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        runtime = CheckpointRuntime.load(checkpoint, device)
        batcher = InflightBatcher(runtime, max_batch_size=max_batch_size)
    except Exception as exc:  # the stub refuses to load, with this reason
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", {"vocab_size": int(runtime.config["vocab_size"]), "device": device}))
    theirs: dict[int, int] = {}  # the batcher's id -> the stub's
    ours: dict[int, int] = {}
    while True:
        while conn.poll(None if batcher.idle else 0):  # EOFError: the stub is gone
            kind, rid, *rest = conn.recv()
            if kind == "submit":
                mine = batcher.submit(rest[0])
                theirs[mine], ours[rid] = rid, mine
            elif rid in ours:
                mine = ours.pop(rid)
                theirs.pop(mine, None)
                batcher.cancel(mine)
        try:
            events = batcher.step()
        except StepFailed as exc:
            failed = [theirs.pop(mine) for mine in exc.requests if mine in theirs]
            for rid in failed:
                ours.pop(rid, None)
            conn.send(("failed", failed, str(exc)))
            continue
        out = []
        for event in events:
            rid = theirs[event.request]
            if event.finished:
                del theirs[event.request], ours[rid]
            out.append(Event(rid, event.token, event.finished, event.reason))
        conn.send(("events", out))


def main(argv: list[str]) -> int:
    name, fd, checkpoint, device, batch = argv
    conn = Connection(int(fd))
    try:
        _serve(conn, Path(checkpoint), device, int(batch))
    except (EOFError, OSError, KeyboardInterrupt):  # the stub closed its end, or is gone
        pass
    return 0


if __name__ == "__main__":
    # a stop signals the server's whole process group: this process ends when its stub closes
    # the connection (a drain's requests finish first), as the Python backend's stubs do
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(main(sys.argv[1:]))
