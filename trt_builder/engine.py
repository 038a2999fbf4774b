"""Engine: the exact `trtllm-build` command, and running it where TensorRT-LLM is installed."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
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


def run_build(argv: list[str], log_path: Path, *, timeout_s: float = 4 * 3600) -> float:
    """Run trtllm-build, streaming its output to `log_path`; raise EngineError on failure."""
    start = time.perf_counter()
    tail: deque[str] = deque(maxlen=8)
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + shlex.join(argv) + "\n")
        try:
            proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        except OSError as exc:
            raise EngineError(
                f"cannot start {argv[0]} ({exc}): check the TensorRT-LLM installation"
            ) from None
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                log.write(line)
                tail.append(line.rstrip())
                if time.perf_counter() - start > timeout_s:
                    proc.kill()
                    raise EngineError(
                        f"trtllm-build ran past {timeout_s:.0f} s and was stopped; see {log_path}"
                    )
            code = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if code != 0:
        last = " | ".join(tail) or "(no output)"
        raise EngineError(
            f"trtllm-build exited with {code}; last lines: {last} (full log: {log_path})"
        )
    return time.perf_counter() - start
