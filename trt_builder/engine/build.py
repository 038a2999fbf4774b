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

from ..core.errors import EngineError
from ..core.versions import tool_version
from ..spec.build import BuildSpec
from .host import gpu_info, local_gpus
from .releases import RELEASES, Release, check_release, release_for

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
    the INT8 KV cache and for an FP8 KV cache beside non-FP8 linears (TensorRT-LLM would turn it
    off itself, with a warning, and with it KV reuse and chunked context), and FP8 checkpoints
    say whether FP8 context FMHA runs, so the command says what the engine will be. FP8 GEMMs:
    `--gemm_plugin auto` (the model dtype) leaves FP8Linear as quantize/dequantize around
    TensorRT's own FP8 matmul; the fp8 GEMM plugin is "experimental" upstream, for batch <= 4."""
    lim = spec.limits
    mode = spec.mode
    fp8 = mode.fp8_context_fmha  # FP8 GEMMs (or NVFP4's, whose builder keeps it too)
    # TensorRT-LLM's builder turns paged context FMHA off for the INT8 KV cache, and for the FP8
    # one unless the linears are FP8 too (then it runs FP8 context FMHA instead: said
    # explicitly, since the flag's default changed between releases)
    paged_off = mode.kv_int8 or (mode.kv_fp8 and not fp8)

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
        "--use_paged_context_fmha", "disable" if paged_off else "enable",
        "--workers", str(spec.tp * spec.pp),
    ]  # fmt: skip
    if fp8:  # FP8 context FMHA goes with the FP8 KV cache only (builder.py drops it otherwise)
        argv += ["--use_fp8_context_fmha", "enable" if mode.kv_fp8 else "disable"]
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


def build_engine(
    spec: BuildSpec,
    toolchain: Toolchain,
    checkpoint: Path,
    output: Path,
    *,
    shown_output: Path,
    log: Path,
    checkpoint_digest: str,
    digest: Callable[[Path], str],
    on_phase: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Check the checkpoint against the installed release, run trtllm-build into `output` and
    write the engine manifest; what ran, for the stage record. `shown_output` is where the
    engine ends up (the command to rerun by hand names it)."""
    config = json.loads((checkpoint / "config.json").read_text())
    check_release(config["architecture"], toolchain.trtllm_version)
    check_gemm_plugin(spec.engine.gemm_plugin, config["dtype"])
    release = (
        RELEASES[-1]
        if toolchain.trtllm_version == "absent"
        else release_for(toolchain.trtllm_version)
    )
    argv = build_command(spec, checkpoint, output, executable=toolchain.executable,
                         release=release)  # fmt: skip
    build = run_build(argv, log, timeout_s=spec.engine.timeout_s, on_phase=on_phase)
    if not list(output.glob("rank*.engine")):
        raise EngineError(
            f"trtllm-build finished but wrote no rank*.engine into the output; see {log}"
        )
    write_engine_manifest(output, argv=argv, trtllm_version=toolchain.trtllm_version,
                          checkpoint_digest=checkpoint_digest, digest=digest)  # fmt: skip
    return {
        "command": shlex.join(build_command(spec, checkpoint, shown_output)),
        "executed": shlex.join(argv),
        "executable": toolchain.executable,
        "build_gpus": local_gpus(),
        "tensorrt_llm": toolchain.trtllm_version,
        "build_seconds": round(build.seconds, 1),
        "phases": [{"phase": phase, "at_s": at} for phase, at in build.phases],
        "log": str(log),
    }
