"""The pipeline's commands: build, each stage on its own (fetch, calibrate, recipe, convert,
verify, engine, package), verify of a checkpoint, engine or deployment on its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.markup import escape

from ..core.errors import VerifyFailed
from . import options
from .app import EPILOG_EXIT, cli, err, run_stages, spec_from
from .render import verify_figures


def _stage_command(name: str, stages: tuple[str, ...], help_text: str, example: str) -> None:
    @options.apply(options.SPEC_OPTIONS, options.RUN_OPTIONS, options.OUTPUT_OPTIONS)
    def command(**kwargs: Any) -> None:
        run_stages(stages, kwargs)

    command.__doc__ = f"{help_text}\n\n\b\nExample:\n  {example}"
    cli.command(name, epilog=EPILOG_EXIT)(command)


_stage_command(
    "build",
    ("fetch", "pad", "calibrate", "recipe", "convert", "verify", "engine", "package"),
    "Run every stage: fetch, pad, calibrate and recipe (when the mode needs them), convert, "
    "verify, engine, package.",
    "trt-builder build --dtype int8",
)
_stage_command(
    "calibrate",
    ("pad", "calibrate"),
    "Collect activation statistics for INT8 (SmoothQuant, the INT8 KV cache); shared by variants.",
    "trt-builder calibrate --calib-samples 128 --calib-seq-len 512",
)
_stage_command(
    "recipe",
    ("recipe",),
    "Search what a mode leaves to measured accuracy, in memory on the calibration device: "
    "SmoothQuant's alphas (--dtype int8 --sq-alpha auto), FP8's weight rounding (--dtype fp8), "
    "INT4 AWQ's scales and rounding (--dtype int4-awq), NVFP4's rounding (--dtype nvfp4); "
    "shared by variants.",
    "trt-builder recipe --dtype int8 --calib-device cuda",
)
_stage_command(
    "fetch",
    ("fetch",),
    "Fetch the model into engines/<model>/<revision>/hf.",
    "trt-builder fetch --model HuggingFaceTB/SmolLM2-135M-Instruct --revision main",
)
_stage_command(
    "convert",
    ("convert",),
    "Convert the fetched model to a TensorRT-LLM checkpoint.",
    "trt-builder convert --dtype bfloat16",
)
_stage_command(
    "engine",
    ("engine",),
    "Build the engine with trtllm-build (or print the command where TensorRT-LLM is absent).",
    "trt-builder engine --dtype float16 --require-engine",
)


@cli.command("package", epilog=EPILOG_EXIT)
@options.apply(options.SPEC_OPTIONS, options.RUN_OPTIONS, options.OUTPUT_OPTIONS)
@click.option(
    "--check",
    "check_dir",
    type=click.Path(path_type=Path),
    help="Only validate this existing Triton model repository (schema, versions, wiring).",
)
def package_command(check_dir: Path | None, **kwargs: Any) -> None:
    """Write the Triton model repository as a new version, validate it and publish it.

    \b
    Examples:
      trt-builder package --dtype float16
      trt-builder package --check triton_repo/smollm2-135m-instruct-b179c952-int8-tp1-pp1
    """
    if check_dir is None:
        run_stages(("package",), kwargs)
        return
    from ..triton.repositories import validate_repository
    from ..triton.repository import INFO

    configs = validate_repository(check_dir)
    try:
        info = json.loads((check_dir / INFO).read_text())
    except (OSError, ValueError):
        info = {}
    if kwargs["as_json"]:
        click.echo(json.dumps({"ok": True, "repository": str(check_dir), "models": sorted(configs),
                               "info": info}, indent=2))  # fmt: skip
    else:
        err.print(f"[green]valid[/]: {escape(str(check_dir))} ({', '.join(sorted(configs))})")


@cli.command("verify", epilog=EPILOG_EXIT)
@options.apply(options.SPEC_OPTIONS, options.RUN_OPTIONS, options.OUTPUT_OPTIONS)
@click.option(
    "--checkpoint",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="A checkpoint directory to verify on its own: TensorRT-LLM's, or the Hugging Face one of --target llmapi (which --runtime llmapi and vllm run).",
)
@click.option(
    "--reference",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="The HF model directory to compare --checkpoint with.",
)
@click.option(
    "--runtime",
    type=click.Choice(["reference", "tensorrt-llm", "llmapi", "vllm", "triton"]),
    default="reference",
    show_default=True,
    help="What runs the model: reference, our checkpoint runtime (a checkpoint); TensorRT-LLM (--engine); TensorRT-LLM's LLM() on an llmapi --checkpoint (TensorRT-LLM >= 1.0 on a GPU host); vLLM's LLM() on an llmapi --checkpoint (scripts/setup.sh --bench installs it); or a Triton deployment (--url).",
)
@click.option(
    "--engine",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="The engine directory for --runtime tensorrt-llm.",
)
@click.option(
    "--url", help="The Triton server for --runtime triton: grpc://host:8001 or http://host:8000."
)
@click.option(
    "--tokenizer",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="The tokenizer the deployment uses, checked against the model's (default: --reference's).",
)
@click.option(
    "--report",
    type=click.Path(path_type=Path),
    default=Path("verify.json"),
    show_default=True,
    help="Where --checkpoint mode writes its JSON report (JUnit XML and HTML go beside it).",
)
def verify_command(
    checkpoint: Path | None,
    reference: Path | None,
    runtime: str,
    engine: Path | None,
    url: str | None,
    tokenizer: Path | None,
    report: Path,
    **kwargs: Any,
) -> None:
    """Compare the model as built with transformers; non-zero exit when a gate fails.

    \b
    Examples:
      trt-builder verify --dtype int8
      trt-builder verify --checkpoint engines/m/r/float16-tp1-pp1/checkpoint --reference engines/m/r/hf
      trt-builder verify --runtime tensorrt-llm --engine engines/m/r/float16-tp1-pp1/engine --reference engines/m/r/hf
      trt-builder verify --runtime llmapi --checkpoint engines/m/r/fp8-llmapi-tp1-pp1/checkpoint --reference engines/m/r/hf
      trt-builder verify --runtime vllm --checkpoint engines/m/r/float16-llmapi-tp1-pp1/checkpoint --reference engines/m/r/hf
      trt-builder verify --runtime triton --url grpc://localhost:8001 --reference engines/m/r/hf
    """
    standalone = any(v is not None for v in (checkpoint, reference, engine, url, tokenizer))
    if not standalone and runtime == "reference":
        run_stages(("verify",), kwargs)
        return
    if reference is None:
        raise click.UsageError(
            "--reference (the HF model directory) is needed to verify a checkpoint, an engine "
            "or a deployment on its own; give none of these to verify a build"
        )
    if runtime == "reference" and checkpoint is None:
        raise click.UsageError(
            "--checkpoint and --reference go together for the checkpoint runtime (--runtime reference)"
        )
    if runtime == "tensorrt-llm" and engine is None:
        raise click.UsageError("--runtime tensorrt-llm needs --engine DIR")
    if runtime in ("llmapi", "vllm") and checkpoint is None:
        raise click.UsageError(
            f"--runtime {runtime} needs --checkpoint DIR: the llmapi checkpoint "
            "(<variant>/checkpoint of a --target llmapi build)"
        )
    if runtime == "triton" and not url:
        raise click.UsageError("--runtime triton needs --url")
    _verify_dirs(checkpoint, reference, report, kwargs,
                 tokenizer=tokenizer, runtime=runtime, engine=engine, url=url)  # fmt: skip


def _verify_dirs(
    checkpoint: Path | None,
    reference: Path,
    report_path: Path,
    kwargs: dict[str, Any],
    *,
    tokenizer: Path | None,
    runtime: str,
    engine: Path | None,
    url: str | None,
) -> None:
    from ..modes import checkpoint_mode
    from ..pipeline.standalone import verify_standalone

    spec = spec_from(dict(kwargs))
    report = verify_standalone(checkpoint, reference, spec, runtime=runtime, engine_dir=engine,
                               url=url, tokenizer=tokenizer, report_path=report_path)  # fmt: skip
    if kwargs.get("as_json"):
        click.echo(json.dumps(report, indent=2, default=str))
        options.OUTPUT.printed = True
    else:
        mode = checkpoint_mode(checkpoint) if checkpoint is not None else spec.mode.name
        verdict = "[green]pass[/]" if report["passed"] else "[red]FAIL[/]"
        html = escape(str(report_path.with_suffix(".html")))
        err.print(f"verify {verdict} ({mode}, {runtime}): {verify_figures(report)}; report: {html}")
    if not report["passed"]:
        raise VerifyFailed(
            f"verify failed: {'; '.join(report['failures'])} (report: {report_path.with_suffix('.html')})"
        )
