"""Engine: the exact `trtllm-build` command, and running it where TensorRT-LLM is installed."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

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


def check_release(architecture: str, trtllm_version: str) -> None:
    """Refuse a build the installed TensorRT-LLM cannot do (when its version is known)."""
    from packaging.version import InvalidVersion, Version

    need = MIN_RELEASE.get(architecture)
    if need is None or trtllm_version == "absent":
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


def build_command(
    spec: BuildSpec, checkpoint: Path, output: Path, *, executable: str = "trtllm-build"
) -> list[str]:
    """The trtllm-build argv for this spec (flags valid for TensorRT-LLM 0.20 through 1.2)."""
    lim = spec.limits
    return [
        executable,
        "--checkpoint_dir", str(checkpoint),
        "--output_dir", str(output),
        "--gemm_plugin", "auto",
        "--gpt_attention_plugin", "auto",
        "--max_batch_size", str(lim.max_batch_size),
        "--max_input_len", str(lim.max_input_len),
        "--max_seq_len", str(lim.max_seq_len),
        "--max_num_tokens", str(lim.max_num_tokens),
        "--max_beam_width", str(lim.max_beam_width),
        "--kv_cache_type", "paged",
        "--remove_input_padding", "enable",
        "--context_fmha", "enable",
        "--workers", str(spec.tp * spec.pp),
    ]  # fmt: skip


def local_gpus() -> list[str]:
    """The GPUs of this host as "name (SM xy)", from nvidia-smi; [] where there is none."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        name, _, cap = line.rpartition(",")
        gpus.append(f"{name.strip()} (SM {cap.strip().replace('.', '')})")
    return gpus


def run_build(argv: list[str], log_path: Path, *, timeout_s: float = 4 * 3600) -> float:
    """Run trtllm-build, streaming its output to `log_path`; raise EngineError on failure."""
    start = time.perf_counter()
    tail: deque[str] = deque(maxlen=8)
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

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise EngineError(
                f"trtllm-build ran past {timeout_s:.0f} s and was stopped; see {log_path}"
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
    return time.perf_counter() - start
