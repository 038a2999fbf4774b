"""Serving a repository and asking it: serve-command, serve, infer, bench."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.markup import escape

from . import options
from .app import EPILOG_EXIT, cli, err


@cli.command("serve-command", epilog=EPILOG_EXIT)
@click.argument("repository", type=click.Path(path_type=Path))
@options.apply(options.PORT_OPTIONS)
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
@options.apply(options.PORT_OPTIONS)
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
    from ..triton.serving import serve_until_stopped

    def say(line: str) -> None:
        err.print(escape(line), soft_wrap=True)

    err.print(escape(serve_until_stopped(repository, http_port=http_port, grpc_port=grpc_port,
                                         metrics_port=metrics_port, timeout=timeout, say=say)))  # fmt: skip


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
    from ..bench.session import run_bench

    bench_options = None
    if not compare_files and len(targets) in (1, 2):
        bench_options = BenchOptions(
            concurrency=_numbers(concurrency, int, "--concurrency"), rates=_numbers(rate, float, "--rate"),
            requests=requests, duration=duration, warmup=warmup, repeats=repeats, prompts=prompts,
            input_tokens=input_tokens, output_tokens=output_tokens, ignore_eos=ignore_eos,
            seed=seed, model=model,
        )  # fmt: skip

    def progress(name: str, text: str) -> None:
        err.print(f"[dim]{escape(name)}: {escape(text)}[/]")

    results = run_bench(targets, bench_options, out, compare_files=compare_files,
                        tokenizer=tokenizer, progress=progress)  # fmt: skip
    if as_json:
        click.echo(json.dumps({"ok": True, "out": str(out), "html": str(out.with_suffix(".html"))}))
        return
    from .render import bench_table

    for result in results:
        click.echo(bench_table(result))
    click.echo(f"wrote {out} and {out.with_suffix('.html')}")
