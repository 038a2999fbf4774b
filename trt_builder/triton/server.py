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
import secrets
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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import InputError, PackageError, TritonError
from .repositories import read_repository
from .repository import current_version
from .serve import serve_command

#: The environment variable that names a tritonserver executable to use.
EXECUTABLE_ENV = "TRT_BUILDER_TRITONSERVER"
NGC = Path("/opt/tritonserver/bin/tritonserver")
#: The Python backend's stub: one process per model instance.
STUB = "triton_python_backend_stub"
#: The reference backend's model process (runtimes/model_process.py), by its command line.
MODEL_PROCESS = "trt_builder.runtimes.model_process"
#: serve restarts a server whose model process died at most this often in this many seconds,
#: then exits 12, for a process supervisor (systemd, Kubernetes) to take over.
MAX_RESTARTS = 3
RESTART_WINDOW_S = 600
#: Seconds a server whose model process died is given, after SIGTERM (readiness false at once),
#: for its living models to answer the cut-off requests with their errors, before it is killed.
DEATH_GRACE_S = 2.0
#: Seconds stop() waits, after tritonserver exits, for the rest of its process group (the
#: stubs, the model processes) before it kills what is left.
GROUP_WAIT_S = 5.0


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
    metrics_port: int = 0
    shm_prefix: str = ""  # its Python backend's shared-memory regions: /dev/shm/<prefix>*
    stubs: dict[int, str] = field(default_factory=dict)  # its model processes when it was ready
    left: list[str] = field(default_factory=list)  # what stop() killed after the server exited

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"grpc://127.0.0.1:{self.grpc_port}"

    def stop(self, grace: float = 30.0) -> int:
        """SIGTERM to the process group (mpirun's ranks, the backends' stubs), SIGKILL after
        `grace` seconds; the server's exit code. `killed` says whether it had to be killed.
        Signals the group even when the server itself has exited, for stubs it left behind;
        then waits GROUP_WAIT_S for the rest of the group to exit and kills what is left,
        naming it in `left`: nothing of the server outlives stop()."""
        _signal_group(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.killed = True
            self.kill()
        deadline = time.monotonic() + GROUP_WAIT_S
        while self.group() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = self.group()
        if left:
            self.left = [f"{name} (pid {pid})" for pid, name in sorted(left.items())]
            self.kill()
        return self.process.returncode

    def group(self) -> dict[int, str]:
        """The living processes of the server's process group, but the server: pid to what
        it is (a model instance's stub or model process, else its command name)."""
        processes = _group(self.process.pid)  # one look at /proc for both
        named = {pid: name for pid, name in self.model_processes(processes).items() if name}
        found = {}
        for pid, (comm, state, _) in processes.items():
            if pid != self.process.pid and state != "Z":
                found[pid] = named.get(pid, comm)
        return found

    def kill(self) -> None:
        """SIGKILL to the whole group, and remove the shared-memory regions its killed Python
        backend stubs leave in /dev/shm."""
        _signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait()
        deadline = time.monotonic() + GROUP_WAIT_S  # killed: gone once their parents reap them
        while self.group() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.shm_prefix:
            for region in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
                region.unlink(missing_ok=True)

    def restart(self, timeout: float = 300.0) -> Server:
        """The same repository on the same ports in a fresh tritonserver. This one is given
        SIGTERM first (its readiness turns false at once) and DEATH_GRACE_S for its living
        models to answer what the death cut off with errors, then killed (a dead stub's
        requests would hold a drain to its end). TritonError if the new one does not start."""
        assert self.repository is not None
        _signal_group(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=DEATH_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        return start(self.repository, http_port=self.http_port, grpc_port=self.grpc_port,
                     metrics_port=self.metrics_port, timeout=timeout)  # fmt: skip

    def reload(self, timeout: float = 300.0) -> int | None:
        """Load the version the repository's link points to now, if it is not the one loaded:
        one explicit `load` of each served model, composing models first (each keeps serving
        its old version until the new one is ready; the `ensemble` is a BLS model, which a
        load does not cascade from). The version
        loaded, or None when nothing changed; TritonError with Triton's reason if it failed
        (the version that was serving still serves; that version is not tried again)."""
        version = None if self.repository is None else current_version(self.repository)
        if version is None or version in (self.version, self.failed):
            return None
        assert self.repository is not None
        try:
            kind, configs = read_repository(self.repository)
        except PackageError as exc:
            self.failed = version
            raise TritonError(
                f"version {version} of {self.repository} was not loaded: {exc}; "
                f"version {self.version} still serves"
            ) from None
        try:
            for model in kind.models(configs):
                url = f"{self.http_url}/v2/repository/models/{model}/load"
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

    def model_processes(
        self, processes: dict[int, tuple[str, str, list[str]]] | None = None
    ) -> dict[int, str | None]:
        """The model processes in the server's process group (`processes`: its _group, if
        already read): pid to what runs there, a Python-backend stub's model instance
        (`tensorrt_llm_0_0`, ...) or the reference backend's model process an instance started
        (`tensorrt_llm_0_0 (PyTorch)`), or None for one that died unreaped (a zombie keeps its
        command name, not its arguments)."""
        found: dict[int, str | None] = {}
        if processes is None:
            processes = _group(self.process.pid)
        for pid, (comm, state, argv) in processes.items():
            if comm == STUB[:15]:  # 15 characters kept
                alive = state != "Z" and len(argv) > 8
                found[pid] = argv[8] if alive else None
            elif MODEL_PROCESS in argv:
                at = argv.index(MODEL_PROCESS) + 1
                found[pid] = f"{argv[at]} (PyTorch)" if state != "Z" and at < len(argv) else None
        return found

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Supervisor:
    """`serve`'s watch over a started server, once a second until Ctrl-C or SIGTERM: a model
    process that died (the OOM killer, a CUDA fault) or a tritonserver that exited by itself
    is restarted on the same ports, at most MAX_RESTARTS times in RESTART_WINDOW_S, and each
    death is said in one line naming what died; then TritonError (exit 12) for a process
    supervisor to take over. A new version `package` publishes is loaded (Server.reload).

    A restart, not a reload through model control: a stub killed mid-request leaves its
    requests hanging (the Python backend never answers them) and can abort tritonserver itself
    (the Python backend's `boost::interprocess::lock_exception`, seen on 2.51). The server is
    given SIGTERM (readiness false at once) and DEATH_GRACE_S for the living models to answer
    what the death cut off with errors (the reference backend for its model process, the BLS
    model for a tensorrt_llm stub), then killed, which ends any stream left with a connection
    error. Until the new server is ready, readiness stays false."""

    def __init__(self, server: Server, *, timeout: float, say: Callable[[str], None]) -> None:
        self.server, self.timeout, self.say = server, timeout, say
        self.restarts: deque[float] = deque()
        self.restarting = False
        self.seen = dict(server.stubs)  # every model process seen alive in this server
        self.retired: set[int] = set()  # those of versions a reload replaced: not watched

    def run(self) -> None:
        """Watch until interrupted (KeyboardInterrupt propagates; the caller stops
        self.server) or recovery fails (TritonError)."""
        while True:
            try:
                self.server.process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            died = self._deaths()
            if died:
                self._restart(died)
                continue
            try:  # a version `package` published since: load it while this one serves
                loaded = self.server.reload()
            except TritonError as exc:  # reported once; the old version goes on serving
                self.say(str(exc))
                continue
            if loaded is not None:  # the old version's processes exit as it unloads
                self.retired |= self.seen.keys()
                self.seen = {}
                self.say(f"version {loaded} of {self.server.repository} loaded")

    def _deaths(self) -> str:
        code = self.server.process.poll()
        if code is not None:
            return f"tritonserver exited by itself with {code}"
        found = {pid: name for pid, name in self.server.model_processes().items()
                 if pid not in self.retired}  # fmt: skip
        self.seen |= {pid: name for pid, name in found.items() if name is not None}
        # gone since seen, or a zombie (also one that died before the first look)
        dead = {self.seen.get(pid, f"(pid {pid}, dead before it was named)")
                for pid in self.seen.keys() | found.keys() if found.get(pid) is None}  # fmt: skip
        if dead and self.server.process.poll() is None:
            return f"model process {', '.join(sorted(dead))} died"
        return ""

    def _restart(self, died: str) -> None:
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > RESTART_WINDOW_S:
            self.restarts.popleft()
        log = self.server.log
        if len(self.restarts) >= MAX_RESTARTS:
            self.server.kill()  # its dead model's requests would hold a drain to the end
            raise TritonError(f"{died} after {MAX_RESTARTS} restarts in "
                              f"{RESTART_WINDOW_S // 60} minutes: giving up (log: {log})")  # fmt: skip
        self.restarts.append(now)
        self.say(f"{died}: restarting tritonserver (restart {len(self.restarts)} of at most "
                 f"{MAX_RESTARTS} in {RESTART_WINDOW_S // 60} minutes; log: {log})")  # fmt: skip
        self.restarting = True  # an interrupt now: start() stops what it began, this one is dead
        self.server = self.server.restart(self.timeout)
        self.restarting = False
        self.seen, self.retired = dict(self.server.stubs), set()
        self.say(f"serving again on {self.server.http_url} (log: {self.server.log})")


def _group(pgid: int) -> dict[int, tuple[str, str, list[str]]]:
    """The processes of process group `pgid`: pid to (command name, state, argv)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            fields = text.rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:
                continue
            comm = text[text.index("(") + 1 : text.rindex(")")]
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # it exited while being read
        found[int(stat.parent.name)] = (comm, fields[0], [a.decode(errors="replace") for a in argv])
    return found


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
    read_repository(repository)[0].check_host(repository)
    served = repository.absolute()  # the link itself: reload() follows it
    shm_prefix = f"trtb{secrets.token_hex(4)}r"  # this server's own, so a kill can clean up
    argv = serve_command(served, tritonserver=str(binary.executable), http_port=http_port,
                         grpc_port=grpc_port, metrics_port=metrics_port,
                         model_repository=served, shm_prefix=shm_prefix)  # fmt: skip
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
    server = Server(process, http_port, grpc_port, log, binary, served, current_version(served),
                    metrics_port=metrics_port, shm_prefix=shm_prefix)  # fmt: skip
    try:
        _wait_ready(server, timeout)
        server.stubs = {pid: name for pid, name in server.model_processes().items() if name}
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
            why = load_failure(text) or (f"tritonserver exited with {server.process.returncode}: "
                                         f"{' | '.join(text.strip().splitlines()[-3:])}")  # fmt: skip
            raise TritonError(f"{why} (log: {server.log})")
        if _ready(server.http_url) and server.process.poll() is None:  # ours answered
            return
        time.sleep(0.5)
    raise TritonError(
        f"tritonserver was not ready after {timeout:g} s (log: {server.log}): raise --timeout"
    )
