"""The load generator: NVIDIA's aiperf (0.13), run as a process of its own environment, one
run a load point, against Triton's HTTP generate_stream endpoint (server-sent events, one a
token, so time to first token and inter-token latency are the client's own measurements).

aiperf has no Triton gRPC transport; its `template` endpoint type sends a payload we give
(data/generate_stream.jinja: the ensemble's `messages` as a chat, `max_tokens`, `stream`;
data/llmapi_stream.jinja: the llmapi model's `text_input`, `sampling_param_max_tokens`,
`streaming`, the prompt left out of the answer) and reads `text_output` from each event. An
llmapi model's events each hold the whole text so far: its point also exports aiperf's raw
records, from which bench/cumulative.py counts the tokens once. Closed-loop points run with a request-rate cap far
above what they reach (without one, aiperf's scheduler spins a core, which a 2-core host's
server loses). What aiperf does not do, and is written here: serving a repository for the
run, the sweep over points and repeats, the comparison and the nightly's gates.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ..core.errors import InputError, TritonError
from .options import BenchOptions

AIPERF_VERSION = "0.13.0"
CLOSED_LOOP_RATE = 1000.0  # requests/s: a cap no point reaches, see the module's docstring
METRICS = {"ttft_ms": "time_to_first_token", "itl_ms": "inter_token_latency",
           "e2e_ms": "request_latency"}  # fmt: skip
STATS = ("avg", "p50", "p90", "p99")


@dataclass(frozen=True)
class Aiperf:
    executable: str
    version: str


def find_aiperf() -> Aiperf:
    """$TRT_BUILDER_AIPERF, else `aiperf` on PATH, else the environment scripts/setup.sh
    --bench makes beside trt-builder's own (.venv-aiperf); InputError naming the install."""
    beside = Path(sys.prefix).parent / ".venv-aiperf" / "bin" / "aiperf"
    exe = os.environ.get("TRT_BUILDER_AIPERF") or shutil.which("aiperf")
    if exe is None and beside.is_file():
        exe = str(beside)
    if exe is None or not Path(exe).exists() and shutil.which(exe) is None:
        raise InputError(
            f"bench needs aiperf {AIPERF_VERSION} in an environment of its own: bash "
            "scripts/setup.sh --bench, or python3 -m venv ~/.aiperf && ~/.aiperf/bin/pip install "
            f"aiperf=={AIPERF_VERSION} and TRT_BUILDER_AIPERF=~/.aiperf/bin/aiperf"
        )
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InputError(f"cannot run {exe} ({exc}): check TRT_BUILDER_AIPERF") from None
    version = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "unknown"
    if version != AIPERF_VERSION:
        raise InputError(
            f"{exe} is aiperf {version}; bench is written against {AIPERF_VERSION}: "
            f"pip install aiperf=={AIPERF_VERSION} in its environment"
        )
    return Aiperf(exe, version)


def template(llmapi: bool = False) -> Path:
    name = "llmapi_stream.jinja" if llmapi else "generate_stream.jinja"
    return Path(str(resources.files(__package__).joinpath(f"data/{name}")))


def command(
    aiperf: Aiperf,
    options: BenchOptions,
    mode: str,
    load: float,
    *,
    url: str,
    tokenizer: Path,
    prompts: Path | None,
    out: Path,
    seed: int,
    llmapi: bool = False,
) -> list[str]:
    """aiperf's command line for one load point (`llmapi`: to an llmapi repository's model,
    with the raw records its token counts are corrected from)."""
    argv = [aiperf.executable, "profile", "--model", options.model, "--tokenizer", str(tokenizer),
            "--url", url, "--endpoint-type", "template",
            "--endpoint", f"/v2/models/{options.model}/generate_stream",
            "--extra-inputs", f"payload_template:{template(llmapi)}",
            "--extra-inputs", "response_field:text_output", "--streaming",
            "--random-seed", str(seed), "--no-gpu-telemetry", "--no-server-metrics",
            "--ui", "none", "--artifact-dir", str(out)]  # fmt: skip
    if llmapi:
        argv += ["--export-level", "raw"]
    if mode == "concurrency":
        argv += ["--concurrency", str(int(load)), "--request-rate", str(CLOSED_LOOP_RATE),
                 "--arrival-pattern", "constant"]  # fmt: skip
    else:
        argv += ["--request-rate", f"{load:g}", "--arrival-pattern", "poisson"]
    if options.duration is not None:
        argv += ["--benchmark-duration", f"{options.duration:g}"]
    else:
        argv += ["--request-count", str(options.requests)]
    if options.warmup:
        argv += ["--warmup-request-count", str(options.warmup)]
    if options.ignore_eos:  # merged into the payload: no token ends an answer early
        argv += ["--extra-inputs", "end_id:-1"]
    if prompts is None:
        argv += ["--isl", str(options.input_tokens), "--isl-stddev", "0",
                 "--osl", str(options.output_tokens), "--osl-stddev", "0"]  # fmt: skip
    else:
        argv += ["--input-file", str(prompts), "--custom-dataset-type", "single-turn"]
    return argv


#: One request of a bench gets this long (aiperf's own default is 6 hours), and a whole point
#: POINT_TIMEOUT_S plus its --duration: a wedged server must not hang bench or the nightly.
REQUEST_TIMEOUT_S = 600
POINT_TIMEOUT_S = 1800.0


def run_point(
    argv: list[str], out: Path, keep_log: Path, timeout: float = POINT_TIMEOUT_S
) -> dict[str, Any]:
    """Run aiperf for one point; its figures (`parse`). TritonError when no request of the
    point was answered (aiperf then writes no figures), with aiperf's own reason, or when the
    point takes longer than `timeout` seconds (aiperf and its workers are killed); its log is
    kept at `keep_log` then."""
    out.mkdir(parents=True, exist_ok=True)
    # nothing left in /tmp: its dataset maps and the directories each of its processes makes
    env = {**os.environ, "AIPERF_DATASET_MMAP_BASE_PATH": str(out), "TMPDIR": str(out)}
    # aiperf 0.13 offline reads a tokenizer *path* as a hub repo id and fails; the tokenizer is
    # always a local directory here, which it loads without the hub when not told offline
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(name, None)
    argv = [*argv, "--request-timeout-seconds", str(REQUEST_TIMEOUT_S)]
    with open(out / "aiperf.log", "w") as log:
        # a session of its own: on a timeout, its worker processes go with it
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)  # fmt: skip
        try:
            code = process.wait(timeout=timeout)
        except BaseException:  # the timeout, or Ctrl-C: no aiperf process is left behind
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
            code = None
    export = out / "profile_export_aiperf.json"
    if code != 0 or not export.is_file():
        keep_log.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "aiperf.log", keep_log)
        if code is None:
            raise TritonError(
                f"the load generator did not finish this point within {timeout:g} s: the "
                f"deployment answers too slowly or not at all; check it with trt-builder infer, "
                f"or ask for fewer --requests (aiperf's log: {keep_log})"
            )
        raise TritonError(
            f"the load generator got no answer at this point ({_last_error(keep_log)}): check "
            f"the deployment with trt-builder infer (aiperf's log: {keep_log})"
        )
    return parse(export, out / "profile_export.jsonl")


def _last_error(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    text = (errors or lines or ["aiperf printed nothing"])[-1]
    return text[-300:]


def parse(export: Path, records: Path | None = None) -> dict[str, Any]:
    """One point's figures from aiperf's export: p50/p90/p99 (and mean) of time to first token,
    inter-token latency and end-to-end latency in ms; requests/s and output tokens/s; the
    requests and the errors (an error is counted, never left out); each answered request's time
    to first token, for the distribution."""
    data = json.loads(export.read_text())
    figures: dict[str, Any] = {}
    for name, key in METRICS.items():
        stat = data.get(key) or {}
        figures[name] = {s: stat.get(s) for s in STATS}
    figures["request_throughput"] = (data.get("request_throughput") or {}).get("avg")
    figures["output_token_throughput"] = (data.get("output_token_throughput") or {}).get("avg")
    answered = int((data.get("request_count") or {}).get("avg") or 0)
    summary = data.get("error_summary") or []
    errors = int((data.get("error_request_count") or {}).get("avg") or 0) or sum(
        int(e.get("count", 0)) for e in summary
    )
    figures["requests"] = answered + errors
    figures["errors"] = errors
    figures["error_kinds"] = [
        {"error": str((e.get("error_details") or {}).get("message", e))[:300],
         "count": int(e.get("count", 0))}
        for e in summary
    ]  # fmt: skip
    figures["duration_s"] = (data.get("benchmark_duration") or {}).get("avg")
    ttft = []
    if records is not None and records.is_file():
        for line in records.read_text().splitlines():
            row = json.loads(line)
            if (row.get("metadata") or {}).get("benchmark_phase") == "warmup":
                continue
            value = ((row.get("metrics") or {}).get("time_to_first_token") or {}).get("value")
            if value is not None:
                ttft.append(round(float(value), 3))
    figures["ttft_samples_ms"] = ttft
    return figures
