"""`trt-builder serve`: a real tritonserver on a repository trt-builder wrote, started, waited
for until every model is ready (or the first one that fails to load is named), and stopped.
The server is given the repository's link (`<triton_root>/<name>`), not the version it points
to, so that a version `package` publishes later is loaded through Triton's model-control API
(Server.reload) while the current one serves.

The server is the NGC container's (`tritonserver` on PATH, or /opt/tritonserver) where there is
one, else the one the nvidia-pytriton wheel ships (`pip install 'trt-builder[serve]'`: tritonserver
2.51 with the Python backend, no tensorrtllm backend, so on such a host the repository needs the
reference backend). The Python models run in this interpreter's environment: its directory goes
first on PATH and its libpython's on LD_LIBRARY_PATH (the backend's stub links against it).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import InputError, TritonError
from .repository import current_version
from .serve import serve_command

#: The environment variable that names a tritonserver executable to use.
EXECUTABLE_ENV = "TRT_BUILDER_TRITONSERVER"
NGC = Path("/opt/tritonserver/bin/tritonserver")


@dataclass(frozen=True)
class Binary:
    """A tritonserver executable and, for the wheel's, the backends directory it needs."""

    executable: Path
    backends: Path | None  # None: the server's own default
    source: str  # "env" | "path" | "ngc" | "pytriton"


def _pytriton() -> Path | None:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    return root if (root / "bin" / "tritonserver").is_file() else None


def find_tritonserver() -> Binary | None:
    """The tritonserver to run: $TRT_BUILDER_TRITONSERVER, PATH's, NGC's, or the wheel's."""
    named = os.environ.get(EXECUTABLE_ENV)
    if named:
        return Binary(Path(named), None, "env")
    on_path = shutil.which("tritonserver")
    if on_path:
        return Binary(Path(on_path), None, "path")
    if NGC.is_file():
        return Binary(NGC, None, "ngc")
    root = _pytriton()
    if root is not None:  # its Python-backend stub is put in place when it starts
        return Binary(root / "bin" / "tritonserver", root / "backends", "pytriton")
    return None


def _wheel_backends(root: Path) -> Path:
    """The wheel's backends with the Python backend's stub for this interpreter in place (the
    wheel ships one stub per Python version beside them); a private copy where the wheel's
    directory cannot be written."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise InputError(
            f"nvidia-pytriton ships no Python backend stub for Python {version}: use a Python "
            "it ships a stub for, or the NGC container's tritonserver"
        )
    backends = root / "backends"
    target = backends / "python" / stub.name
    try:
        if not target.is_file():
            shutil.copy2(stub, target)
        return backends
    except OSError:
        private = Path(tempfile.gettempdir()) / f"trt-builder-backends-{os.getuid()}-py{version}"
        if not (private / "python" / stub.name).is_file():
            shutil.copytree(backends, private, dirs_exist_ok=True)
            shutil.copy2(stub, private / "python" / stub.name)
        return private


def server_environment() -> dict[str, str]:
    """The environment the Python models run in: this interpreter's (its bin first on PATH, its
    libpython on the loader path)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (libdir, env.get("LD_LIBRARY_PATH")) if p
        )
    return env


#: tritonserver's line for a model that failed to load, and its reason.
_FAILED = re.compile(r"failed to load '([^']+)' version \d+: (.+?)(?<!\\)\"?$")


def load_failure(log: str) -> str | None:
    """The first model that failed to load and why, from tritonserver's log, in one line."""
    for line in log.splitlines():
        match = _FAILED.search(line)
        if match:
            reason = match.group(2).replace("\\n", " ").replace('\\"', '"').split(" At: ")[0]
            return f"model {match.group(1)} failed to load: {' '.join(reason.split())}"
    return None


@dataclass
class Server:
    """A running tritonserver; stop() ends it (SIGTERM, then SIGKILL after `grace` seconds)."""

    process: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int
    log: Path
    binary: Binary
    repository: Path | None = None  # the link served, as given
    version: int | None = None  # the published version loaded
    failed: int | None = None  # the last version that failed to load (not retried)
    notes: list[str] = field(default_factory=list)
    killed: bool = False  # stop() had to SIGKILL it

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"grpc://127.0.0.1:{self.grpc_port}"

    def stop(self, grace: float = 30.0) -> int:
        """SIGTERM to the process group (mpirun's ranks, the backends' stubs), SIGKILL after
        `grace` seconds; the server's exit code. `killed` says whether it had to be killed.
        Signals the group even when the server itself has exited, for stubs it left behind."""
        _signal_group(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.killed = True
            _signal_group(self.process.pid, signal.SIGKILL)
            self.process.wait()
        return self.process.returncode

    def reload(self, timeout: float = 300.0) -> int | None:
        """Load the version the repository's link points to now, if it is not the one loaded:
        one explicit `load` of the ensemble, which makes Triton poll it and its composing
        models (each keeps serving its old version until the new one is ready). The version
        loaded, or None when nothing changed; TritonError with Triton's reason if it failed
        (the version that was serving still serves; that version is not tried again)."""
        version = None if self.repository is None else current_version(self.repository)
        if version is None or version in (self.version, self.failed):
            return None
        url = f"{self.http_url}/v2/repository/models/ensemble/load"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"),
                                        timeout=timeout):  # fmt: skip
                pass
        except urllib.error.HTTPError as exc:
            self.failed = version
            reason = exc.read().decode(errors="replace")
            raise TritonError(
                f"version {version} of {self.repository} failed to load ({reason}); "
                f"version {self.version} still serves (log: {self.log})"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            self.failed = version
            raise TritonError(f"tritonserver did not answer the load of version {version} "
                              f"({exc}; log: {self.log})") from None  # fmt: skip
        self.version = version
        return version

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):  # the whole group has exited already
        pass


#: tritonserver's line for an HTTP or gRPC port it could not bind.
_IN_USE = re.compile(r"Socket '[^']*:(\d+)' already in use|[Aa]ddress already in use")


def _triton_on(port: int) -> bool:
    """Whether a Triton server answers HTTP on `port` (its server metadata at /v2)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2", timeout=2) as answer:
            return b'"name"' in answer.read(4096)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def check_ports(ports: dict[str, int]) -> None:
    """InputError naming the first port (by its option) that another process listens on, and
    whether that process is a Triton server, before tritonserver is started: a server on a busy
    port would fail in its own log, while the other server's readiness answered ours."""
    for option, port in ports.items():
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is free
            try:
                probe.bind(("0.0.0.0", port))  # tritonserver listens on every address
                continue
            except OSError:
                pass
        flag = "--" + option.replace("_", "-")
        who = (
            f"another Triton server answers on it (http://127.0.0.1:{port}): stop that one, or"
            if _triton_on(port)
            else "another process listens on it: free it, or"
        )
        raise InputError(f"port {port} ({flag}) is in use: {who} choose another with {flag}")


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def start(
    repository: Path,
    *,
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    timeout: float = 300.0,
    log: Path | None = None,
) -> Server:
    """Start tritonserver on `repository` (explicit model control, strict readiness) and wait
    until every model is ready. TritonError naming the model and Triton's reason when one fails
    to load; InputError when no tritonserver is installed."""
    binary = find_tritonserver()
    if binary is None:
        raise InputError(
            "no tritonserver here: use the NGC Triton container, or pip install "
            "'trt-builder[serve]' (tritonserver with the Python backend, for the reference backend)"
        )
    check_ports({"http_port": http_port, "grpc_port": grpc_port, "metrics_port": metrics_port})
    served = repository.absolute()  # the link itself: reload() follows it
    argv = serve_command(served, tritonserver=str(binary.executable), http_port=http_port,
                         grpc_port=grpc_port, metrics_port=metrics_port,
                         model_repository=served)  # fmt: skip
    if binary.source == "pytriton":
        backends = _wheel_backends(binary.executable.parents[1])
        argv.insert(argv.index(str(binary.executable)) + 1, f"--backend-directory={backends}")
    if log is None:
        fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
        os.close(fd)
        log = Path(name)
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                   env=server_environment(), start_new_session=True)  # fmt: skip
    server = Server(process, http_port, grpc_port, log, binary, served, current_version(served))
    try:
        _wait_ready(server, timeout)
    except BaseException:  # a refusal, a timeout, Ctrl-C: never leave it running
        server.stop()
        raise
    return server


def _wait_ready(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            text = server.log.read_text(errors="replace")
            busy = _IN_USE.search(text)
            if busy:  # taken between check_ports and the server's bind
                raise InputError(f"tritonserver could not listen: {busy.group(0)}: choose other "
                                 "ports (--http-port, --grpc-port, --metrics-port)")  # fmt: skip
            raise TritonError(load_failure(text) or f"tritonserver exited with "
                              f"{server.process.returncode}: "
                              f"{' | '.join(text.strip().splitlines()[-3:])} (log: {server.log})")  # fmt: skip
        if _ready(server.http_url) and server.process.poll() is None:  # ours answered
            return
        time.sleep(0.5)
    raise TritonError(
        f"tritonserver was not ready after {timeout:g} s (log: {server.log}): raise --timeout"
    )
