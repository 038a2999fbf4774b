"""`trt-builder`: thin commands over trt_builder.pipeline; errors become one line and an exit code."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

from .. import __version__
from ..core.errors import EXIT_CODES, TrtBuilderError, VerifyFailed, library_error
from ..pipeline.build import BuildResult, run
from ..spec.build import load_toml, make_spec
from . import options
from .render import StageProgress, summary, verify_figures

err = Console(stderr=True, highlight=False)

EPILOG_EXIT = "\b\nExit codes:\n" + "\n".join(
    f"  {code:>3}  {text}" for code, text in EXIT_CODES.items()
)


def _spec_from(kwargs: dict[str, Any]) -> Any:
    config = kwargs.pop("config", None)
    toml = load_toml(config) if config else None
    return make_spec(
        toml, **{key: kwargs.pop(param, None) for param, key in options.SPEC_KEYS.items()}
    )


def _run(stages: tuple[str, ...], kwargs: dict[str, Any]) -> None:
    as_json = kwargs.pop("as_json")
    force, dry_run, lock_timeout = (
        kwargs.pop("force"),
        kwargs.pop("dry_run"),
        kwargs.pop("lock_timeout"),
    )
    spec = _spec_from(kwargs)
    progress = None if as_json else StageProgress(err)
    result = run(spec, only=stages, force=force, dry_run=dry_run, lock_timeout=lock_timeout,
                 listener=progress, check=False)  # fmt: skip
    if result.error is not None and not isinstance(result.error, VerifyFailed):
        raise result.error  # one line on stderr (and {"ok": false} with --json)
    _report(result, as_json, ok=result.error is None)
    if result.error is not None:
        raise result.error


def _report(result: BuildResult, as_json: bool, *, ok: bool) -> None:
    if as_json:
        click.echo(json.dumps({"ok": ok, **result.to_json()}, indent=2, default=str))
        options.OUTPUT.printed = True
    else:
        summary(err, result)


@click.group(
    epilog=EPILOG_EXIT,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(__version__, prog_name="trt-builder")
def cli() -> None:
    """Build TensorRT-LLM checkpoints, engines and Triton repositories from Hugging Face models,
    and verify them against transformers.

    \b
    Example:
      trt-builder build --dtype int8
    """


def _stage_command(name: str, stages: tuple[str, ...], help_text: str, example: str) -> None:
    @options.apply(options.SPEC_OPTIONS, options.RUN_OPTIONS, options.OUTPUT_OPTIONS)
    def command(**kwargs: Any) -> None:
        _run(stages, kwargs)

    command.__doc__ = f"{help_text}\n\n\b\nExample:\n  {example}"
    cli.command(name, epilog=EPILOG_EXIT)(command)


_stage_command(
    "build",
    ("fetch", "calibrate", "recipe", "convert", "verify", "engine", "package"),
    "Run every stage: fetch, calibrate and recipe (when the mode needs them), convert, verify, "
    "engine, package.",
    "trt-builder build --dtype int8",
)
_stage_command(
    "calibrate",
    ("calibrate",),
    "Collect activation statistics for INT8 (SmoothQuant, the INT8 KV cache); shared by variants.",
    "trt-builder calibrate --calib-samples 128 --calib-seq-len 512",
)
_stage_command(
    "recipe",
    ("recipe",),
    "Search what a mode leaves to measured accuracy, in memory on the calibration device: "
    "SmoothQuant's alphas (--dtype int8 --sq-alpha auto), FP8's weight rounding (--dtype fp8); "
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
        _run(("package",), kwargs)
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
    help="A checkpoint directory to verify on its own: TensorRT-LLM's, or the Hugging Face one of --target llmapi (which --runtime llmapi runs).",
)
@click.option(
    "--reference",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="The HF model directory to compare --checkpoint with.",
)
@click.option(
    "--runtime",
    type=click.Choice(["reference", "tensorrt-llm", "llmapi", "triton"]),
    default="reference",
    show_default=True,
    help="What runs the model: reference, our checkpoint runtime (a checkpoint); TensorRT-LLM (--engine); TensorRT-LLM's LLM() on an llmapi --checkpoint (TensorRT-LLM >= 1.0 on a GPU host); or a Triton deployment (--url).",
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
      trt-builder verify --runtime triton --url grpc://localhost:8001 --reference engines/m/r/hf
    """
    standalone = any(v is not None for v in (checkpoint, reference, engine, url, tokenizer))
    if not standalone and runtime == "reference":
        _run(("verify",), kwargs)
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
    if runtime == "llmapi" and checkpoint is None:
        raise click.UsageError(
            "--runtime llmapi needs --checkpoint DIR: the llmapi checkpoint "
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

    spec = _spec_from(dict(kwargs))
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


@cli.command("plan", epilog=EPILOG_EXIT)
@options.apply(options.SPEC_OPTIONS, options.OUTPUT_OPTIONS)
def plan_command(**kwargs: Any) -> None:
    """Print the memory plan of the engine on the target GPU: weights, KV cache per token,
    activations, and how many sequences fit (from the model's config.json alone: no weights).

    \b
    Example:
      trt-builder plan --model meta-llama/Llama-2-7b-hf --dtype int8 --target-gpu A100-80GB
    """
    from ..engine.memplan import GIB, proposed_batch
    from ..pipeline.plan import plan_memory
    from ..targets import TARGET_MAKES

    as_json = kwargs["as_json"]
    spec = _spec_from(dict(kwargs))
    memory = plan_memory(spec)
    source = {True: "from the plan", False: "given"}
    makes = f"{spec.target}: {TARGET_MAKES[spec.target]}"
    if as_json:
        data = {"ok": True, "target": spec.target, "makes": TARGET_MAKES[spec.target],
                **memory.to_json()}  # fmt: skip
        click.echo(json.dumps(data, indent=2))
        return
    lim = memory.limits
    rows = [
        ("builds", makes),
        ("target", f"{memory.gpu} ({memory.gpu_bytes / GIB:g} GiB), tp={memory.tp} pp={memory.pp}"),
        ("weights per rank", f"{memory.weight_bytes / GIB:.2f} GiB ({memory.weight_dtype} linears)"),
        ("activations (estimate)", f"{memory.activation_bytes / GIB:.2f} GiB for {lim.max_num_tokens} tokens"),
        ("runtime overhead", f"{memory.overhead_bytes / GIB:.2f} GiB"),
        ("KV cache per token", f"{memory.kv_bytes_per_token / 1024:.1f} KiB ({memory.kv_dtype})"),
        (f"KV cache ({memory.kv_fraction:g} of the rest)", f"{memory.kv_budget_bytes / GIB:.2f} GiB = {memory.kv_tokens} tokens"),
        (f"sequences of {lim.max_seq_len} tokens at once", str(memory.max_sequences(lim.max_seq_len))),
        ("max_batch_size", f"{lim.max_batch_size} ({source[spec.limits.max_batch_size is None]}; "
                           f"{proposed_batch(memory)} fit)"),
        ("max_num_tokens", f"{lim.max_num_tokens} ({source[spec.limits.max_num_tokens is None]})"),
    ]  # fmt: skip
    for label, value in rows:
        click.echo(f"{label:<34} {value}")


@cli.command("serve-command", epilog=EPILOG_EXIT)
@click.argument("repository", type=click.Path(path_type=Path))
@click.option("--http-port", type=int, default=8000, show_default=True)
@click.option("--grpc-port", type=int, default=8001, show_default=True)
@click.option("--metrics-port", type=int, default=8002, show_default=True)
@click.option("--tritonserver", default="tritonserver", show_default=True,
              help="The tritonserver executable.")  # fmt: skip
@options.DEBUG_OPTION
def serve_command_cli(repository: Path, http_port: int, grpc_port: int, metrics_port: int,
                      tritonserver: str) -> None:  # fmt: skip
    """Print the tritonserver command (under mpirun for tp x pp > 1) that serves a repository
    trt-builder wrote: explicit model control, strict readiness, exit on error.

    \b
    Example:
      trt-builder serve-command triton_repo/smollm2-135m-instruct-b179c952-int8-tp1-pp1
    """
    import shlex

    from ..triton.serve import serve_command

    argv = serve_command(repository, tritonserver=tritonserver, http_port=http_port,
                         grpc_port=grpc_port, metrics_port=metrics_port)  # fmt: skip
    click.echo(shlex.join(argv))


@cli.command("serve", epilog=EPILOG_EXIT)
@click.argument("repository", type=click.Path(path_type=Path))
@click.option("--http-port", type=int, default=8000, show_default=True)
@click.option("--grpc-port", type=int, default=8001, show_default=True)
@click.option("--metrics-port", type=int, default=8002, show_default=True)
@click.option("--timeout", type=float, default=300.0, show_default=True,
              help="Seconds to wait for every model to be ready.")  # fmt: skip
@options.DEBUG_OPTION
def serve_cli(repository: Path, http_port: int, grpc_port: int, metrics_port: int,
              timeout: float) -> None:  # fmt: skip
    """Serve a repository trt-builder wrote with a real tritonserver (the NGC container's, or
    the nvidia-pytriton wheel's: trt-builder[serve]) until Ctrl-C or SIGTERM. Explicit model
    control, strict readiness; a model that fails to load is named with Triton's reason. A
    version that `package` publishes while it serves is loaded, the old one serving meanwhile.

    \b
    Example:
      trt-builder serve triton_repo/smollm2-135m-instruct-b179c952-int8-sq-tp1-pp1
    """
    import signal

    from ..core.errors import TritonError
    from ..triton.repository import INFO, REFERENCE
    from ..triton.serve import EXIT_TIMEOUT_S
    from ..triton.server import Supervisor, start

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # also while it starts: start() stops what it began
    supervisor = None
    server = start(repository, http_port=http_port, grpc_port=grpc_port,
                   metrics_port=metrics_port, timeout=timeout)  # fmt: skip
    try:  # from here on, whatever happens, the server is stopped before serve returns
        try:
            info = json.loads((repository / INFO).read_text())
        except (OSError, ValueError):
            info = {}
        what = REFERENCE if info.get("backend") == "reference" else "TensorRT-LLM engine"
        err.print(f"serving {escape(str(repository))} on {server.http_url} and {server.grpc_url} "
                  f"(tensorrt_llm: {what}; tritonserver from {server.binary.source}, log: "
                  f"{escape(str(server.log))}); Ctrl-C stops it", soft_wrap=True)  # fmt: skip
        supervisor = Supervisor(server, timeout=timeout,
                                say=lambda line: err.print(escape(line), soft_wrap=True))  # fmt: skip
        supervisor.run()
    except KeyboardInterrupt:
        pass
    finally:
        if supervisor is not None:
            server = supervisor.server  # the one serving now, after any restarts
        code = server.stop()
    if server.left:  # the group is waited for: what outlived the server is named, then killed
        err.print(f"killed what tritonserver left running after it exited: "
                  f"{', '.join(server.left)}", soft_wrap=True)  # fmt: skip
    if supervisor is not None and supervisor.restarting:  # stopped while a new one started
        err.print("tritonserver stopped (during a restart)")
        return
    if server.killed:  # a supervisor should know the drain did not finish
        raise TritonError(f"tritonserver did not stop within 30 s of SIGTERM and was killed "
                          f"(log: {server.log})")  # fmt: skip
    if code != 0:  # Triton's own: requests still in flight when its exit timeout passed
        raise TritonError(f"tritonserver stopped with exit {code}: requests in flight "
                          f"{EXIT_TIMEOUT_S} s after the stop were cut off (log: {server.log})")  # fmt: skip
    err.print(f"tritonserver stopped (exit {code})")


@cli.command("infer", epilog=EPILOG_EXIT)
@click.option("--url", required=True,
              help="grpc://HOST:8001 (gRPC; needed for --stream) or http://HOST:8000.")  # fmt: skip
@click.option("--prompt", help="Plain text (the ensemble's text_input).")
@click.option("--messages", help='A chat as JSON, or @FILE: [{"role": "user", "content": "..."}].')
@click.option("--image", help="An image URL, for an llmapi repository of a vision-language "
              "model (its image_url input).")  # fmt: skip
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float)
@click.option("--top-k", type=int)
@click.option("--top-p", type=float)
@click.option("--seed", type=click.IntRange(0, 2**64 - 1),
              help="Sampling seed (the backend's `seed` input), for repeatable sampled answers.")  # fmt: skip
@click.option(
    "--stream", is_flag=True, help="Print the answer as it comes (a streaming repository)."
)
@click.option("--model", help="The model to ask [default: ensemble, or tensorrt_llm for an "
              "llmapi repository; with --stream, tensorrt_llm_bls where the server has it: its "
              "pieces are whole characters].")  # fmt: skip
@click.option(
    "--timeout", type=float, default=60.0, show_default=True, help="Seconds per response."
)
@options.apply(options.OUTPUT_OPTIONS)
def infer_command(url: str, prompt: str | None, messages: str | None, image: str | None,
                  max_tokens: int,
                  temperature: float | None, top_k: int | None, top_p: float | None,
                  seed: int | None, stream: bool, model: str | None, timeout: float,
                  as_json: bool) -> None:  # fmt: skip
    """Send one request to a live Triton deployment of a trt-builder repository and print the
    answer (checks readiness first; fails after --timeout).

    \b
    Example:
      trt-builder infer --url grpc://localhost:8001 --prompt "The capital of France is"
    """
    from ..core.errors import InputError
    from ..triton import client

    chat = None
    if messages is not None:
        try:
            text = Path(messages[1:]).read_text() if messages.startswith("@") else messages
        except OSError as exc:
            raise InputError(
                f"cannot read {messages[1:]} ({exc.strerror}): check the path"
            ) from None
        try:
            chat = json.loads(text)
        except ValueError:
            raise InputError(
                '--messages is not JSON: give [{"role": "user", "content": "..."}]'
            ) from None
    sampling = {k: v for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                                  ("seed", seed)) if v is not None}  # fmt: skip
    request = client.Request(prompt=prompt, messages=chat, max_tokens=max_tokens,
                             sampling=sampling, image=image)  # fmt: skip
    if stream:
        pieces = []
        if model is None and not url.startswith(("http://", "https://")):
            model = client.stream_model(client.connect(url, timeout=timeout)[1])
        for piece in client.stream(url, request, model=model, timeout=timeout):
            pieces.append(piece)
            if not as_json:
                click.echo(piece, nl=False)
        answer = "".join(pieces)
        if not as_json:
            click.echo()
    else:
        answer = client.generate(url, request, model=model, timeout=timeout)
        if not as_json:
            click.echo(answer)
    if as_json:
        click.echo(json.dumps({"ok": True, "url": url, "model": model, "text": answer}, indent=2))


def _numbers(text: str | None, kind: type, flag: str) -> tuple[Any, ...]:
    if not text:
        return ()
    try:
        return tuple(kind(x) for x in text.split(","))
    except ValueError:
        raise click.BadParameter(
            f"{text!r}: give numbers separated by commas", param_hint=flag
        ) from None


@cli.command("bench", epilog=EPILOG_EXIT)
@click.argument("targets", nargs=-1, metavar="[TARGET [TARGET]]")
@click.option("--concurrency", default="1,2,4,8", show_default=True,
              help="Closed-loop points: requests kept in flight, comma-separated ('' for none).")  # fmt: skip
@click.option(
    "--rate", default="", help="Open-loop points: Poisson arrivals, requests/s, comma-separated."
)
@click.option("--requests", type=int, default=32, show_default=True, help="Requests a point.")
@click.option("--duration", type=float, help="Seconds a point, instead of --requests.")
@click.option("--warmup", type=int, default=2, show_default=True, help="Warm-up requests a point.")
@click.option("--repeats", type=int, default=1, show_default=True,
              help="Runs of every point (3 or more give the spread a comparison judges by).")  # fmt: skip
@click.option("--prompts", default="bundled", show_default=True,
              help="bundled (verify's prompt set), synthetic, or a JSONL file of {\"text\": ...} lines.")  # fmt: skip
@click.option(
    "--input-tokens", type=int, default=128, show_default=True, help="Synthetic prompts' length."
)
@click.option("--output-tokens", type=int, default=64, show_default=True,
              help="Each answer's longest length (every answer's, with --ignore-eos).")  # fmt: skip
@click.option("--ignore-eos", is_flag=True,
              help="Every answer --output-tokens long: the end token does not end it (end_id -1).")  # fmt: skip
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--model", default="", help="The model to load [default: tensorrt_llm for an "
              "llmapi deployment; tensorrt_llm_bls where the deployment has it (whole streamed "
              "text), else ensemble].")  # fmt: skip
@click.option("--tokenizer", type=click.Path(path_type=Path),
              help="The deployment's tokenizer, for a URL (a repository's own is used otherwise).")  # fmt: skip
@click.option("--compare", "compare_files", nargs=2, type=click.Path(path_type=Path),
              metavar="A.json B.json", help="Compare two earlier results (no load is run).")  # fmt: skip
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench.json"), show_default=True,
              help="The result (JSON); the HTML page goes beside it.")  # fmt: skip
@options.apply(options.OUTPUT_OPTIONS)
def bench_command(targets: tuple[str, ...], concurrency: str, rate: str, requests: int,
                  duration: float | None, warmup: int, repeats: int, prompts: str,
                  input_tokens: int, output_tokens: int, ignore_eos: bool, seed: int,
                  model: str, tokenizer: Path | None, compare_files: tuple[Path, Path] | None, out: Path,
                  as_json: bool) -> None:  # fmt: skip
    """Load-test a Triton deployment of a trt-builder repository with aiperf: time to first
    token, inter-token latency, end-to-end latency and throughput at each concurrency or
    request rate. TARGET is a running deployment's HTTP URL, or a repository directory served
    for the run (a real tritonserver, stopped afterwards). Two targets are run one after the
    other and compared; --compare compares two earlier results.

    \b
    Examples:
      trt-builder bench triton_repo/smollm2-135m-instruct --concurrency 1,2,4,8
      trt-builder bench http://localhost:8000 --tokenizer engines/.../hf --rate 0.5,1,2
      trt-builder bench --compare fp16.json int8.json --out int8-vs-fp16.json
    """
    from ..bench.options import BenchOptions
    from ..core.errors import InputError, SpecError
    from ..core.fsio import write_json, write_text

    if compare_files:
        if targets:
            raise SpecError("give targets to run, or --compare with two results, not both")
        results = [_load_result(path) for path in compare_files]
    else:
        if len(targets) not in (1, 2):
            raise SpecError("give one target (a URL or a repository), two to compare, or --compare")
        bench_options = BenchOptions(
            concurrency=_numbers(concurrency, int, "--concurrency"), rates=_numbers(rate, float, "--rate"),
            requests=requests, duration=duration, warmup=warmup, repeats=repeats, prompts=prompts,
            input_tokens=input_tokens, output_tokens=output_tokens, ignore_eos=ignore_eos,
            seed=seed, model=model,
        )  # fmt: skip
        if bench_options.prompts.endswith(".jsonl") and not Path(bench_options.prompts).is_file():
            raise InputError(f"--prompts {bench_options.prompts}: no such file")
        from ..bench.run import bench

        results = []
        for i, target in enumerate(targets):
            path = out if len(targets) == 1 else out.with_name(f"{out.stem}.{'ab'[i]}.json")

            def progress(text: str, name: str = target) -> None:
                err.print(f"[dim]{escape(name)}: {escape(text)}[/]")

            results.append(
                bench(target, bench_options, path, tokenizer=tokenizer, progress=progress)
            )
    if len(results) == 2:
        from ..bench.compare import compare
        from ..bench.report import html_page

        page = html_page(results)
        write_json(out, {"results": results, "comparison": compare(*results)})
        write_text(out.with_suffix(".html"), page)
    if as_json:
        click.echo(json.dumps({"ok": True, "out": str(out), "html": str(out.with_suffix(".html"))}))
        return
    from .render import bench_table

    for result in results:
        click.echo(bench_table(result))
    click.echo(f"wrote {out} and {out.with_suffix('.html')}")


def _load_result(path: Path) -> dict[str, Any]:
    from ..core.errors import InputError

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(
            f"cannot read {path} ({exc}): give a result trt-builder bench wrote"
        ) from None
    if not isinstance(data, dict) or "points" not in data:
        raise InputError(
            f"{path} is not a bench result (no points): give a file trt-builder bench wrote"
        )
    return data


@cli.command("nightly", epilog=EPILOG_EXIT)
@click.argument("fleet_file", metavar="FLEET", type=click.Path(path_type=Path))
@click.option("--entry", "entries", multiple=True, metavar="ID",
              help="Only this entry (MODEL/VARIANT) or model id; repeatable.")  # fmt: skip
@click.option("--matrix", is_flag=True,
              help="Print a GitHub Actions matrix (one line of JSON) of the entries and exit.")  # fmt: skip
@click.option("--offline", is_flag=True,
              help="Ask no hub: the pin, else the last run's commit, else the HF cache's.")  # fmt: skip
@click.option("--accept", multiple=True, metavar="ID",
              help="Accept this entry's (or model's) regressions: its figures become the baseline.")  # fmt: skip
@click.option("--report-dir", type=click.Path(path_type=Path), default=Path("nightly-reports"),
              show_default=True, help="Where nightly.json, nightly.junit.xml and nightly.md go.")  # fmt: skip
@click.option("--lock-timeout", type=float, default=600.0, show_default=True,
              help="Seconds to wait for another build of the same target.")  # fmt: skip
@options.apply(options.OUTPUT_OPTIONS)
def nightly_command(fleet_file: Path, entries: tuple[str, ...], matrix: bool, offline: bool,
                    accept: tuple[str, ...], report_dir: Path, lock_timeout: float,
                    as_json: bool) -> None:  # fmt: skip
    """Rebuild a fleet (models x variants, a TOML file): resolve upstream revisions, rerun only
    the stages whose keys changed, verify, and compare each metric with the entry's last good
    run. Exits 11 when an entry fails a gate, errors, or regressed beyond its tolerance.

    \b
    Examples:
      trt-builder nightly fleet.toml
      trt-builder nightly fleet.toml --matrix
      trt-builder nightly fleet.toml --entry smollm2/int8 --report-dir reports
    """
    import os

    from ..fleet.file import load_fleet
    from ..fleet.nightly import check, run_nightly
    from ..fleet.report import write_reports

    fleet = load_fleet(fleet_file)
    if matrix:
        click.echo(json.dumps(fleet.matrix(fleet.select(entries)), separators=(",", ":")))
        return
    if offline:  # trt-builder's own code takes offline=True; the datasets library (an hf:
        os.environ["HF_HUB_OFFLINE"] = "1"  # calibration set) reads only the environment
    progress = None if as_json else StageProgress(err)

    def on_entry(event: str, i: int, n: int, er: Any) -> None:
        if as_json:
            return
        if event == "start":
            err.print(f"[bold][{i + 1}/{n}] {escape(er.entry.id)}[/]")
            return
        style = {"passed": "green", "failed": "red", "regressed": "red"}.get(er.status, "red")
        rebuilt = ", ".join(er.rebuilt) if er.rebuilt else "nothing rebuilt"
        err.print(f"  [{style}]{er.status}[/] ({rebuilt}, {er.seconds:.1f} s)")
        for line in er.regression_messages or ([er.message] if er.message else []):
            err.print(f"  [red]{escape(line)}[/]", soft_wrap=True)

    result = run_nightly(fleet, select=entries, offline=True if offline else None, accept=accept,
                         lock_timeout=lock_timeout, listener=progress, on_entry=on_entry)  # fmt: skip
    paths = write_reports(result, report_dir)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2, default=str))
    else:
        counts = result.counts()
        err.print(
            f"nightly {fleet.name}: {counts['passed']}/{len(result.entries)} good in "
            f"{result.seconds:.1f} s; reports: {escape(str(paths['markdown']))}, "
            f"{escape(str(paths['junit']))}"
        )
    options.OUTPUT.printed = as_json  # a failing run's JSON result is already on stdout
    check(result, paths["markdown"])


@cli.command("gc", epilog=EPILOG_EXIT)
@click.argument("fleet_files", metavar="FLEET...", nargs=-1, required=True,
                type=click.Path(path_type=Path))  # fmt: skip
@click.option("--older-than", type=options.Duration(least=0),
              help="Remove only what was last built longer ago (e.g. 7d, 12h, 0). Default: the "
              "fleet's [gc] older_than, else 7d.")  # fmt: skip
@click.option("--keep-revisions", type=click.IntRange(min=0),
              help="Unreferenced revisions of each model kept anyway, newest first (default: "
              "[gc] keep_revisions, else 1: the one before, for a rollback).")  # fmt: skip
@click.option("--dry-run", is_flag=True, help="List what would be removed; remove nothing.")
@options.apply(options.OUTPUT_OPTIONS)
def gc_command(fleet_files: tuple[Path, ...], older_than: int | None,
               keep_revisions: int | None, dry_run: bool, as_json: bool) -> None:  # fmt: skip
    """Remove old variants and their Triton repositories from the fleets' roots, never one a
    fleet references (what it builds now, and what its last run and last good run built).

    \b
    Examples:
      trt-builder gc fleet.toml --dry-run
      trt-builder gc fleet.toml --older-than 14d --keep-revisions 2
    """
    from ..fleet.file import load_fleet
    from ..fleet.gc import collect

    fleets = [load_fleet(path) for path in fleet_files]
    result = collect(fleets, older_than=older_than, keep_revisions=keep_revisions,
                     dry_run=dry_run)  # fmt: skip
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
        return
    verb = "would remove" if dry_run else "removed"
    for removal in result.removed:
        err.print(f"{verb} {removal.kind} {escape(str(removal.path))} "
                  f"({removal.bytes / 2**20:.1f} MiB): {escape(removal.reason)}")  # fmt: skip
    for note in result.notes:
        err.print(f"[yellow]note:[/] {escape(note)}")
    err.print(f"{verb} {len(result.removed)} item(s), {result.freed / 2**20:.1f} MiB; "
              f"kept {len(result.kept)} referenced variant(s)")  # fmt: skip


@cli.command("doctor")
@click.option("--out", type=click.Path(path_type=Path), default=Path("engines"), show_default=True,
              help="Engines root whose disk is checked.")  # fmt: skip
@options.apply(options.OUTPUT_OPTIONS)
def doctor_command(out: Path, as_json: bool) -> None:
    """What this host has (GPUs, driver, CUDA, TensorRT, TensorRT-LLM, tritonserver, memory,
    disk) and, per mode, what it can do here: build (checkpoint, verify, repository), build the
    engine, serve.

    \b
    Example:
      trt-builder doctor
    """
    from ..pipeline.doctor import inspect

    report = inspect(out)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    gpus = "; ".join(f"{g['name']} (SM {g['sm']}, {g['memory_mib'] / 1024:.0f} GiB)"
                     for g in report["gpus"]) or "none visible"  # fmt: skip
    driver = report["gpus"][0]["driver"] if report["gpus"] else "n/a"
    rows = [
        ("GPUs", gpus),
        ("driver / CUDA (driver)", f"{driver} / {report['cuda_driver'] or 'n/a'}"),
        ("TensorRT", report["tensorrt"]),
        ("TensorRT-LLM", f"{report['tensorrt_llm']} ({report['trtllm_build'] or 'no trtllm-build'})"),
        ("torch", report["torch"]),
        ("tritonserver", report["tritonserver"] or "absent"),
        ("host memory", f"{report['host_memory_gib']} GiB"),
        ("free disk", f"{report['free_disk_gib']} GiB at {report['disk_path']}"),
    ]  # fmt: skip
    for label, value in rows:
        click.echo(f"{label:<24} {value}")
    for mode, can in report["modes"].items():
        for what in ("build", "engine", "serve"):
            click.echo(f"{mode + ' ' + what:<24} {can[what]}")
    for target, can in report["targets"].items():
        click.echo(f"{'--target ' + target:<24} {can['makes']}")
        click.echo(f"{'  runs here':<24} {can['here']}")


@cli.command("models")
def models_command() -> None:
    """List the supported architectures.

    \b
    Example:
      trt-builder models
    """
    from ..models.registry import load_all

    for arch, family in sorted(load_all().items()):
        notes = f"  ({'; '.join(family.notes)})" if family.notes else ""
        click.echo(f"{arch:<36} family={family.name}{notes}")


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI, map every error to one line and a documented exit code."""
    args = sys.argv[1:] if argv is None else argv
    out = options.OUTPUT
    out.json = out.debug = out.printed = False  # set by the command's --json / --debug
    try:
        cli.main(args=args, prog_name="trt-builder", standalone_mode=False)
        return 0
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return 2
    except click.exceptions.Abort:
        err.print("interrupted")
        return 130
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    except Exception as exc:  # the one place an error becomes a message and an exit code
        known = exc if isinstance(exc, TrtBuilderError) else library_error(exc)
        if out.debug:
            traceback.print_exc()
        if known is not None:
            err.print(f"[red]error:[/] {escape(str(known))}", soft_wrap=True)
            if out.json and not out.printed:
                click.echo(json.dumps({"ok": False, "error": str(known),
                                       "exit_code": known.exit_code}))  # fmt: skip
            return known.exit_code
        err.print(
            f"[red]internal error:[/] {type(exc).__name__}: {escape(str(exc))} "
            "(rerun with --debug and report it)",
            soft_wrap=True,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
