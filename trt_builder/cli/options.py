"""Options shared by the build commands, defined once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from ..core.errors import SpecError
from ..fleet.file import parse_duration
from ..modes import DTYPE_CHOICES, DTYPE_HELP, KV_CACHE_CHOICES, check_alpha
from ..spec.build import GEMM_PLUGINS
from ..spec.gpus import GPUS
from ..targets import TARGETS

F = Callable[..., Any]


class _Alpha(click.ParamType):
    """`auto` or a number from 0 to 1 (the spec's int8.alpha)."""

    name = "auto|0..1"

    def convert(self, value: Any, param: Any, ctx: Any) -> float | str:
        try:
            alpha = check_alpha(value)  # SmoothQuant's room validates it
        except SpecError as exc:
            self.fail(str(exc), param, ctx)
        return "auto" if alpha is None else alpha


ALPHA = _Alpha()


class Duration(click.ParamType):
    """Seconds, or a number with s, m, h or d: 90m, 4h, 7d."""

    name = "duration"

    def __init__(self, least: int = 1) -> None:
        self.least = least

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:

        try:
            return parse_duration(value, "the duration", self.least)
        except SpecError as exc:
            self.fail(str(exc).removeprefix("the duration: "), param, ctx)


DURATION = Duration()

SPEC_OPTIONS: tuple[Callable[[F], F], ...] = (
    click.option(
        "--config",
        "config",
        type=click.Path(path_type=Path),
        help="TOML build spec; flags override it.",
    ),
    click.option(
        "--model",
        help="HF repo id (org/name), a local model directory or a .gguf file. Default: the embedded SmolLM2-135M-Instruct.",
    ),
    click.option(
        "--revision", help="Hub branch, tag or commit (resolved to a commit sha and recorded)."
    ),
    click.option(
        "--dtype",
        type=click.Choice(DTYPE_CHOICES),
        help=DTYPE_HELP,
    ),
    click.option(
        "--target",
        type=click.Choice(TARGETS),
        help="What to build: engine (default: a TensorRT-LLM checkpoint for trtllm-build 0.20-1.2 "
        "and an inflight_batcher_llm repository) or llmapi (a Hugging Face checkpoint for "
        "TensorRT-LLM's PyTorch backend, trtllm-serve and vLLM, and a Triton llmapi repository).",
    ),
    click.option(
        "--kv-cache",
        type=click.Choice(KV_CACHE_CHOICES),
        help="KV cache precision: the model dtype (default), int8 or fp8 (SM 89+); both "
        "calibrated (int8 with any --dtype but fp8, fp8 with any).",
    ),
    click.option(
        "--sq-alpha",
        type=ALPHA,
        help="SmoothQuant alpha for --dtype int8: auto (default: searched on the calibration "
        "corpus) or a number from 0 to 1.",
    ),
    click.option(
        "--sq-granularity",
        type=click.Choice(["per-token", "per-tensor"]),
        help="INT8 activation scales: per-token (default, dynamic) or per-tensor (static).",
    ),
    click.option(
        "--wo-clip/--no-wo-clip",
        default=None,
        help="For --dtype int8-wo: clip each weight row where that lowers the calibrated output "
        "error (default), or leave the builder's plain rounding (no calibration).",
    ),
    click.option(
        "--fp8-search/--no-fp8-search",
        default=None,
        help="For --dtype fp8: the recipe stage chooses each weight's rounding, "
        "error-compensated or to nearest, by accuracy on held-apart text (default), or every "
        "weight is rounded to nearest, as modelopt writes it (no recipe stage).",
    ),
    click.option(
        "--group-size",
        type=int,
        help="For --dtype int4-awq: input channels per INT4 scale, 64 or 128 (default: 128 "
        "where the model's shapes take it, else 64).",
    ),
    click.option("--tp", type=int, help="Tensor-parallel ranks (default 1)."),
    click.option("--pp", type=int, help="Pipeline-parallel ranks (default 1)."),
    click.option(
        "--out", type=click.Path(path_type=Path), help="Engines root (default ./engines)."
    ),
    click.option(
        "--triton-root",
        type=click.Path(path_type=Path),
        help="Triton repositories root (default ./triton_repo).",
    ),
    click.option(
        "--backend",
        type=click.Choice(["auto", "tensorrtllm", "reference"]),
        help="The Triton repository's tensorrt_llm model: the engine on NVIDIA's backend, or the "
        "checkpoint on trt-builder's PyTorch reference backend (not TensorRT-LLM; any host). "
        "Default auto: the engine when one was built, else the reference backend.",
    ),
    click.option(
        "--target-gpu",
        type=click.Choice(sorted(GPUS)),
        help="GPU the engine is built for (default H100-80GB).",
    ),
    click.option(
        "--max-batch-size",
        type=int,
        help="Engine limit (default: the sequences of max-seq-len that fit the target GPU, "
        "from the memory plan).",
    ),
    click.option("--max-input-len", type=int, help="Engine limit (default 1024)."),
    click.option("--max-seq-len", type=int, help="Engine limit (default 2048)."),
    click.option(
        "--max-num-tokens",
        type=int,
        help="Engine limit: tokens in one step (default 8192, or batch x max-seq-len if less).",
    ),
    click.option(
        "--gemm-plugin",
        type=click.Choice(GEMM_PLUGINS),
        help="trtllm-build --gemm_plugin (default auto: the checkpoint's activation dtype).",
    ),
    click.option(
        "--build-timeout",
        type=DURATION,
        help="Stop trtllm-build after this long: seconds, or 90m, 4h (default 4h).",
    ),
    click.option(
        "--device",
        type=click.Choice(["auto", "cpu", "cuda"]),
        help="Where verify runs (default auto).",
    ),
    click.option("--min-top1", type=float, help="Verify gate: least top-1 agreement (0-1)."),
    click.option("--max-kl", type=float, help="Verify gate: largest mean KL divergence."),
    click.option(
        "--max-ppl-delta",
        type=float,
        help="Verify gate: largest held-out perplexity increase, in percent.",
    ),
    click.option(
        "--heldout-tokens",
        type=int,
        help="Held-out tokens for verify's perplexity (default 2048; 0 skips it).",
    ),
    click.option(
        "--calib-dataset",
        help="Calibration text: 'bundled' (default), a .txt or .jsonl file, or hf:NAME[:SPLIT[:FIELD]].",
    ),
    click.option("--calib-samples", type=int, help="Calibration samples (default 64)."),
    click.option("--calib-seq-len", type=int, help="Tokens per calibration sample (default 256)."),
    click.option(
        "--calib-seed", type=int, help="Seed that orders the calibration documents (default 0)."
    ),
    click.option("--calib-batch-size", type=int, help="Calibration batch size (default 8)."),
    click.option(
        "--calib-device",
        type=click.Choice(["auto", "cpu", "cuda"]),
        help="Where calibrate runs (default auto; cuda uses every GPU and offloads what does not fit).",
    ),
    click.option(
        "--allow-pickle",
        is_flag=True,
        default=None,
        help="Accept pickle (*.bin) weights, loaded with weights_only=True.",
    ),
    click.option(
        "--require-engine",
        is_flag=True,
        default=None,
        help="Fail when TensorRT-LLM is not installed instead of skipping the engine.",
    ),
)

#: How long to wait for the lock of a build of the same target (build commands, nightly).
LOCK_TIMEOUT = click.option(
    "--lock-timeout",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds to wait for another build of the same target.",
)

RUN_OPTIONS: tuple[Callable[[F], F], ...] = (
    click.option("--force", is_flag=True, help="Rerun stages even when their cache key matches."),
    click.option(
        "--dry-run", is_flag=True, help="Show what would run (keys, cached or not) and do nothing."
    ),
    LOCK_TIMEOUT,
)

#: The ports a tritonserver listens on (serve, serve-command).
PORT_OPTIONS: tuple[Callable[[F], F], ...] = (
    click.option("--http-port", type=int, default=8000, show_default=True),
    click.option("--grpc-port", type=int, default=8001, show_default=True),
    click.option("--metrics-port", type=int, default=8002, show_default=True),
)


@dataclass
class Output:
    """What the output options asked for, kept for main() (which maps errors to messages after
    the command is gone): JSON on stdout, tracebacks, and whether the command already printed
    its own JSON result."""

    json: bool = False
    debug: bool = False
    printed: bool = False


#: The current command's output options (main() resets it for every command).
OUTPUT = Output()


def _remember(field: str) -> Callable[[click.Context, click.Parameter, bool], bool]:
    def callback(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
        setattr(OUTPUT, field, bool(value))
        return value

    return callback


#: Eager, so that they hold even when another option's value is refused.
JSON_OPTION = click.option("--json", "as_json", is_flag=True, is_eager=True,
                           callback=_remember("json"), help="Print the result as JSON on stdout.")  # fmt: skip
DEBUG_OPTION = click.option("--debug", is_flag=True, is_eager=True, expose_value=False,
                            callback=_remember("debug"), help="Show tracebacks.")  # fmt: skip
OUTPUT_OPTIONS: tuple[Callable[[F], F], ...] = (JSON_OPTION, DEBUG_OPTION)


def apply(*groups: tuple[Callable[[F], F], ...]) -> Callable[[F], F]:
    def decorate(fn: F) -> F:
        for group in reversed(groups):
            for option in reversed(group):
                fn = option(fn)
        return fn

    return decorate


#: CLI parameter name -> build-spec key ("section.key" for [limits] and [verify]).
SPEC_KEYS: dict[str, str] = {
    "model": "model", "revision": "revision", "dtype": "dtype", "target": "target", "tp": "tp", "pp": "pp", "out": "out",
    "triton_root": "triton_root", "backend": "triton.backend", "target_gpu": "target_gpu", "allow_pickle": "allow_pickle",
    "require_engine": "require_engine", "max_batch_size": "limits.max_batch_size",
    "max_input_len": "limits.max_input_len", "max_seq_len": "limits.max_seq_len",
    "max_num_tokens": "limits.max_num_tokens", "gemm_plugin": "engine.gemm_plugin",
    "build_timeout": "engine.timeout_s", "device": "verify.device",
    "min_top1": "verify.min_top1", "max_kl": "verify.max_kl", "max_ppl_delta": "verify.max_ppl_delta_pct",
    "heldout_tokens": "verify.heldout_tokens", "calib_dataset": "calibrate.dataset",
    "calib_samples": "calibrate.samples", "calib_seq_len": "calibrate.seq_len", "calib_seed": "calibrate.seed",
    "calib_batch_size": "calibrate.batch_size", "calib_device": "calibrate.device", "kv_cache": "kv_cache",
    "sq_alpha": "int8.alpha", "sq_granularity": "int8.granularity", "wo_clip": "int8.wo_clip",
    "fp8_search": "fp8.search", "group_size": "int4.group_size",
}  # fmt: skip
