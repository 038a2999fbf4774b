"""Engine: the exact `trtllm-build` command, and running it where TensorRT-LLM is installed."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import EngineError
from .spec import BuildSpec
from .versions import tool_version

#: The environment variable that names a trtllm-build executable to use instead of PATH's.
EXECUTABLE_ENV = "TRT_BUILDER_TRTLLM_BUILD"


@dataclass(frozen=True)
class Toolchain:
    """A trtllm-build executable and the TensorRT-LLM version installed beside it."""

    executable: str
    trtllm_version: str  # "absent" when the Python package is not importable here


def find_toolchain() -> Toolchain | None:
    """The trtllm-build to run, or None where TensorRT-LLM is not installed."""
    exe = os.environ.get(EXECUTABLE_ENV) or shutil.which("trtllm-build")
    if not exe:
        return None
    return Toolchain(exe, tool_version("tensorrt-llm"))


#: Architectures whose TensorRT-backend engines need a minimum TensorRT-LLM release.
MIN_RELEASE = {"Qwen3ForCausalLM": "1.0"}


@dataclass(frozen=True)
class Release:
    """A pinned TensorRT-LLM release line (docs/engine.md has the sources)."""

    version: str  # major.minor
    tensorrt: str | None  # the TensorRT it is built with (an engine needs the same at run time)
    container: str | None  # the NGC tritonserver:<tag>-trtllm-python-py3 that ships it
    rejects: frozenset[str] = frozenset()  # trtllm-build flags it no longer accepts


#: Releases that still ship trtllm-build. In all of them the flags we pass exist with the same
#: meaning and `--tokens_per_block` defaults to 32; SmoothQuant `*_PLUGIN` checkpoints switch
#: the SmoothQuant plugins on by themselves (builder.py), so no release takes a flag for them.
RELEASES = (
    Release("0.20", "10.10", "25.06"),
    Release("0.21", "10.11", "25.08"),
    Release("1.0", "10.11", "25.09"),
    Release("1.1", "10.13", "25.12"),
    Release("1.2", None, None, frozenset({"--auto_parallel", "--gpus_per_node", "--cluster_key"})),
)
PINNED = f">={RELEASES[0].version},<1.3"
#: The release the Dockerfile's image is built on: the newest whose NGC container is known.
IMAGE_RELEASE = next(r for r in reversed(RELEASES) if r.container)


def container_image(release: Release = IMAGE_RELEASE) -> str:
    """The NGC Triton + TensorRT-LLM image that ships `release` (the Dockerfile's base)."""
    return f"nvcr.io/nvidia/tritonserver:{release.container}-trtllm-python-py3"


def release_for(trtllm_version: str) -> Release:
    """The release line of an installed TensorRT-LLM; refuses one outside the pinned range."""
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(trtllm_version)
    except InvalidVersion:
        raise EngineError(
            f"TensorRT-LLM version {trtllm_version!r} is not readable: install tensorrt-llm{PINNED}"
        ) from None
    for release in RELEASES:
        if (v.major, v.minor) == tuple(int(x) for x in release.version.split(".")):
            return release
    raise EngineError(
        f"TensorRT-LLM {trtllm_version} is not a pinned release (it must still ship trtllm-build "
        f"with the TensorRT backend): install tensorrt-llm{PINNED} or use its NGC container"
    )


def check_release(architecture: str, trtllm_version: str) -> None:
    """Refuse a build the installed TensorRT-LLM cannot do (when its version is known)."""
    from packaging.version import InvalidVersion, Version

    if trtllm_version == "absent":
        return
    release_for(trtllm_version)
    need = MIN_RELEASE.get(architecture)
    if need is None:
        return
    try:
        too_old = Version(trtllm_version) < Version(need)
    except InvalidVersion:
        return
    if too_old:
        raise EngineError(
            f"{architecture} engines need TensorRT-LLM >= {need}, this host has {trtllm_version}: "
            f"install tensorrt-llm>={need},<1.3 (or use the matching NGC container)"
        )


#: What the command shows for a limit the memory plan sets, before the model's config is here.
UNPLANNED = "<from the memory plan>"


def build_command(
    spec: BuildSpec,
    checkpoint: Path,
    output: Path,
    *,
    executable: str = "trtllm-build",
    release: Release = RELEASES[-1],
) -> list[str]:
    """The trtllm-build argv for this spec and release. Paged context FMHA is turned off for
    the INT8 KV cache (TensorRT-LLM would turn it off itself, with a warning, and with it KV
    reuse and chunked context), so the command says what the engine will be."""
    lim = spec.limits
    kv_int8 = bool(getattr(spec.mode, "kv_int8", False))

    def planned(value: int | None) -> str:  # None: the memory plan decides, once it has the config
        return UNPLANNED if value is None else str(value)

    argv = [
        executable,
        "--checkpoint_dir", str(checkpoint),
        "--output_dir", str(output),
        "--gemm_plugin", spec.engine.gemm_plugin,
        "--gpt_attention_plugin", "auto",
        "--max_batch_size", planned(lim.max_batch_size),
        "--max_input_len", str(lim.max_input_len),
        "--max_seq_len", str(lim.max_seq_len),
        "--max_num_tokens", planned(lim.max_num_tokens),
        "--max_beam_width", str(lim.max_beam_width),
        "--kv_cache_type", "paged",
        "--tokens_per_block", "32",
        "--remove_input_padding", "enable",
        "--context_fmha", "enable",
        "--use_paged_context_fmha", "disable" if kv_int8 else "enable",
        "--workers", str(spec.tp * spec.pp),
    ]  # fmt: skip
    rejected = [flag for flag in argv if flag in release.rejects]
    if rejected:  # a table bug, never the user's: fail loudly
        raise EngineError(
            f"internal: {rejected[0]} is not accepted by TensorRT-LLM {release.version}"
        )
    return argv


def planned_engine_config(spec: BuildSpec, checkpoint_config: dict[str, Any]) -> dict[str, Any]:
    """The parts of the engine's config.json that the Triton repository reads, as the build
    command will make them: for packaging before the engine exists (the same reader then
    reads the real one, so the two cannot drift)."""
    argv = build_command(spec, Path("CHECKPOINT"), Path("OUTPUT"))
    flags = dict(zip(argv[1::2], argv[2::2], strict=True))
    build: dict[str, Any] = {
        key: int(flags[f"--{key}"])
        for key in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens",
                    "max_beam_width")
    }  # fmt: skip
    build["kv_cache_type"] = flags["--kv_cache_type"].upper()
    build["plugin_config"] = {
        "use_paged_context_fmha": flags["--use_paged_context_fmha"] == "enable",
        "remove_input_padding": flags["--remove_input_padding"] == "enable",
        "gemm_plugin": flags["--gemm_plugin"],
    }
    return {"version": "planned", "pretrained_config": checkpoint_config, "build_config": build}


def gpu_info() -> list[dict[str, Any]]:
    """Each GPU of this host (nvidia-smi): name, SM (e.g. 90), memory in MiB, driver; []
    where there is none."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,compute_cap,memory.total,driver_version",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        name, cap, memory, driver = parts
        try:
            found.append({"name": name, "sm": int(cap.replace(".", "")),
                          "memory_mib": int(float(memory)), "driver": driver})  # fmt: skip
        except ValueError:
            continue
    return found


def local_gpus() -> list[str]:
    """The GPUs of this host as "name (SM xy)"; [] where there is none."""
    return [f"{g['name']} (SM {g['sm']})" for g in gpu_info()]


#: trtllm-build's log lines that start a phase of the build, in the order they come, with
#: the phase line shown while it lasts ({0} is the pattern's group). The same lines in every
#: pinned release; with several ranks they interleave, and the line follows the latest.
PHASES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), label)
    for pattern, label in (
        (r"\[TRT-LLM\] \[I\] Set \w+ to ", "reading the checkpoint and flags"),
        (r"Init builder kernel library|constructing network", "constructing the network"),
        (r"Build TensorRT engine", "TensorRT is optimizing the engine (the longest phase)"),
        (r"Engine generation completed in ([\d.]+) seconds", "engine generated in {0} s"),
        (r"Serializing engine to \S*?(rank\d+)\.engine", "writing {0}.engine"),
        (r"Total time of building all engines", "all ranks built"),
    )
)


def phase_of(line: str) -> str | None:
    """The phase a log line starts, or None."""
    for pattern, label in PHASES:
        match = pattern.search(line)
        if match:
            return label.format(*match.groups())
    return None


@dataclass
class BuildRun:
    """What a finished trtllm-build took: seconds in all, and when each phase began."""

    seconds: float
    phases: list[tuple[str, float]]  # (phase, seconds since the start)


def run_build(
    argv: list[str],
    log_path: Path,
    *,
    timeout_s: float = 4 * 3600,
    on_phase: Callable[[str], None] | None = None,
) -> BuildRun:
    """Run trtllm-build, streaming its output to `log_path` and each new phase to `on_phase`;
    raise EngineError on failure, quoting the last lines of the log."""
    start = time.perf_counter()
    tail: deque[str] = deque(maxlen=8)
    phases: list[tuple[str, float]] = []
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + shlex.join(argv) + "\n")
        log.flush()
        try:
            proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        except OSError as exc:
            raise EngineError(
                f"cannot start {argv[0]} ({exc}): check the TensorRT-LLM installation"
            ) from None

        def pump() -> None:  # a thread, so a silent hang still meets the timeout
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                tail.append(line.rstrip())
                phase = phase_of(line)
                if phase is not None and (not phases or phases[-1][0] != phase):
                    phases.append((phase, round(time.perf_counter() - start, 1)))
                    if on_phase is not None:
                        on_phase(phase)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            reader.join(timeout=5)
            last = phases[-1][0] if phases else "before its first phase"
            raise EngineError(
                f"trtllm-build ran past {timeout_s:.0f} s ({last}) and was stopped; raise "
                f"--build-timeout if the model needs longer (log: {log_path})"
            ) from None
        finally:
            if proc.poll() is None:  # interrupted: never leave a build running
                proc.kill()
                proc.wait()
            reader.join(timeout=5)
    if code != 0:
        last = " | ".join(tail) or "(no output)"
        raise EngineError(
            f"trtllm-build exited with {code}; last lines: {last} (full log: {log_path})"
        )
    return BuildRun(time.perf_counter() - start, phases)


def check_gemm_plugin(gemm_plugin: str, checkpoint_dtype: str) -> None:
    """An explicit --gemm-plugin must be the checkpoint's activation dtype (a GEMM plugin of
    another dtype fails inside TensorRT, after the network is built)."""
    if gemm_plugin not in ("auto", checkpoint_dtype):
        raise EngineError(
            f"--gemm-plugin {gemm_plugin} does not match the checkpoint's {checkpoint_dtype} "
            f"activations: use --gemm-plugin auto (or {checkpoint_dtype})"
        )


#: The engine manifest trt-builder writes beside rank*.engine (TensorRT-LLM's config.json
#: records no GPU, SM or TensorRT version).
MANIFEST = "trt-builder-engine.json"


def write_engine_manifest(
    engine_dir: Path, *, argv: list[str], trtllm_version: str, checkpoint_digest: str,
    digest: Callable[[Path], str],
) -> dict[str, Any]:  # fmt: skip
    """Versions, build GPUs, flags, the checkpoint's digest and each engine file's sha256."""
    gpus = gpu_info()
    data = {
        "tensorrt_llm": trtllm_version,
        "tensorrt": tool_version("tensorrt"),
        "gpus": [f"{g['name']} (SM {g['sm']})" for g in gpus],
        "sm": sorted({g["sm"] for g in gpus}),
        "argv": argv[1:],
        "checkpoint_digest": checkpoint_digest,
        "files": {
            p.name: digest(p)
            for p in sorted(engine_dir.iterdir())
            if p.is_file() and p.name != MANIFEST
        },
    }
    (engine_dir / MANIFEST).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return data


def check_engine(engine_dir: Path, *, digest: Callable[[Path], str]) -> str | None:
    """Refuse an engine whose files changed since its build, or that this host cannot run (a
    different TensorRT-LLM or TensorRT, or a GPU of another SM, where those are present here).
    Returns a note for an engine built by hand (no manifest: nothing to check against)."""
    path = engine_dir / MANIFEST
    if not path.is_file():
        return (
            f"{engine_dir} has no {MANIFEST} (built by hand?): its files and host are not checked"
        )
    try:
        manifest = json.loads(path.read_text())
        files = dict(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError):
        raise EngineError(
            f"{path} is damaged: rebuild the engine (trt-builder engine --force)"
        ) from None
    for name, want in sorted(files.items()):
        if not (engine_dir / name).is_file() or digest(engine_dir / name) != want:
            raise EngineError(
                f"engine file {engine_dir / name} no longer matches its digest from the build: "
                "rebuild the engine (trt-builder engine --force)"
            )
    for tool, key in (("tensorrt-llm", "tensorrt_llm"), ("tensorrt", "tensorrt")):
        here, built = tool_version(tool), manifest.get(key)
        if here != "absent" and built not in (None, "absent") and here != built:
            raise EngineError(
                f"the engine in {engine_dir} was built with {tool} {built}, this host has {here}: "
                "rebuild it here (trt-builder engine --force)"
            )
    built_sms, here_sms = manifest.get("sm") or [], sorted({g["sm"] for g in gpu_info()})
    if built_sms and here_sms and not set(here_sms) <= set(built_sms):
        raise EngineError(
            f"the engine in {engine_dir} was built on SM {', '.join(map(str, built_sms))}, this "
            f"host's GPUs are SM {', '.join(map(str, here_sms))}: rebuild it on this GPU type "
            "(trt-builder engine --force)"
        )
    return None
