"""A bench from start to end: the target (a running deployment's URL, or a repository served
for the run by a real tritonserver and stopped afterwards) checked before any load, every
load point run `repeats` times by aiperf, the result written atomically (JSON and HTML)."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from .. import __version__
from ..core.errors import InputError, PackageError, TritonError
from ..core.fsio import write_json, write_text
from ..triton import server as triton_server
from ..triton.client import connect, stream_model
from ..triton.repositories import read_repository
from .cumulative import recount, token_counter
from .figures import summarize
from .loadgen import POINT_TIMEOUT_S, command, find_aiperf, run_point
from .options import BenchOptions
from .prompts import read_jsonl, write_prompts


def _http(url: str, path: str, timeout: float, data: bytes | None = None) -> Any:
    with urllib.request.urlopen(
        urllib.request.Request(url + path, data=data), timeout=timeout
    ) as r:
        body = r.read()
    return json.loads(body) if body else None


def check_deployment(url: str, model: str, timeout: float = 10.0) -> dict[str, str]:
    """Refuse, before any load, a URL that does not answer, a model it does not serve, and a
    deployment that cannot stream (generate_stream needs a decoupled tensorrt_llm model). What
    serves the tensorrt_llm model: its backend, the reference backend's own statement, and its
    contract ("llmapi": TensorRT-LLM's llmapi model, text in, the whole text so far in each
    streamed response; "ensemble": the engine target's repository)."""
    if url.startswith("grpc://"):
        raise InputError(
            f"{url}: bench streams over Triton's HTTP generate_stream endpoint (aiperf has no "
            "gRPC transport): give the server's HTTP address, e.g. http://localhost:8000"
        )
    try:
        _http(url, "/v2/health/ready", timeout)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TritonError(
            f"cannot reach {url} ({reason}): start the deployment (trt-builder serve) or fix --url"
        ) from None
    try:
        _http(url, f"/v2/models/{model}/ready", timeout)
        config = _http(url, "/v2/models/tensorrt_llm/config", timeout) or {}
    except (urllib.error.URLError, OSError, ValueError):
        raise TritonError(
            f"{url} does not serve a ready {model!r} and tensorrt_llm: bench needs a trt-builder "
            "repository (its ensemble), or --model for another name"
        ) from None
    if not (config.get("model_transaction_policy") or {}).get("decoupled"):
        raise PackageError(
            f"{url}: tensorrt_llm is not decoupled, so generate_stream cannot stream tokens: "
            "package with [triton] streaming = true (trt-builder package --config)"
        )
    implementation = ((config.get("parameters") or {}).get("implementation") or {}).get(
        "string_value", ""
    )
    llmapi = any(i.get("name") == "text_input" for i in config.get("input") or [])
    return {"backend": str(config.get("backend", "")), "implementation": implementation,
            "contract": "llmapi" if llmapi else "ensemble"}  # fmt: skip


def _stream_model(url: str) -> str:
    """client.stream_model for the deployment at `url`; the ensemble where it cannot be asked
    (check_deployment then says why)."""
    try:
        _, client, _ = connect(url, timeout=10.0)
    except InputError:
        return "ensemble"
    return stream_model(client)


def _free_ports(n: int) -> list[int]:
    """n distinct free ports: each socket is held until all are chosen (one closed before the
    next bind could be handed out again)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


@contextlib.contextmanager
def deployment(target: str, model: str, log: Path) -> Iterator[tuple[str, Path | None]]:
    """(HTTP URL, the repository's tokenizer or None) of `target`: a URL as it is, or a
    repository directory served by a tritonserver for the duration (stopped afterwards), its
    log at `log` (kept: the errors that name it point there)."""
    if "://" in target:
        yield target.rstrip("/"), None
        return
    repository = Path(target)
    if not repository.exists():
        raise InputError(f"{target} is neither a URL nor a repository: give --url or a directory")
    kind, configs = read_repository(repository)
    config = configs.get("tensorrt_llm")
    if config is None or not config.model_transaction_policy.decoupled:
        raise PackageError(
            f"{repository}: tensorrt_llm is not decoupled, so generate_stream cannot stream "
            "tokens: package with [triton] streaming = true (trt-builder package --config)"
        )
    tokenizer = kind.tokenizer(repository)
    ports = dict(zip(("http_port", "grpc_port", "metrics_port"), _free_ports(3), strict=True))
    log.parent.mkdir(parents=True, exist_ok=True)
    with triton_server.start(repository, log=log, **ports) as server:
        yield server.http_url, tokenizer


def bench(
    target: str,
    options: BenchOptions,
    out: Path,
    *,
    tokenizer: Path | None = None,
    progress: Callable[[str], None] = lambda _text: None,
) -> dict[str, Any]:
    """Run `options`' load points against `target`; write `out` (JSON) and its HTML page
    beside it, both whole or not at all; return the result."""
    if out.suffix != ".json":
        raise InputError(f"--out {out}: give a .json path (the HTML page goes beside it)")
    aiperf = find_aiperf()
    work = Path(tempfile.mkdtemp(prefix="trt-builder-bench-"))
    try:
        if options.prompts.endswith(".jsonl"):
            read_jsonl(Path(options.prompts))  # a bad file is refused before a server starts
        served = deployment(target, options.model, out.with_suffix(".tritonserver.log"))
        with served as (url, served_tokenizer):
            options = replace(options, model=options.model or _stream_model(url))
            serving = check_deployment(url, options.model)
            tok = tokenizer or served_tokenizer
            if tok is None or not Path(tok).is_dir():
                raise InputError(
                    "bench needs the deployment's tokenizer to count tokens: pass --tokenizer "
                    "DIR (the repository's preprocessing/tokenizer or llmapi checkpoint, or the "
                    "model's hf/)"
                )
            llmapi = serving["contract"] == "llmapi"
            if llmapi and options.ignore_eos:
                raise InputError(
                    "--ignore-eos: the llmapi model (TensorRT-LLM's template) has no input that "
                    "ignores the end token; bench it without --ignore-eos"
                )
            # the llmapi model applies no chat template: the prompts go to it rendered
            prompts = write_prompts(options, work, chat=Path(tok) if llmapi else None)
            count = token_counter(Path(tok)) if llmapi else None
            started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            points = []
            for mode, load in options.points():
                repeats = []
                for repeat in range(options.repeats):
                    progress(f"{mode} {load:g}, run {repeat + 1} of {options.repeats}")
                    point_dir = work / f"{mode}-{load:g}-{repeat}"
                    argv = command(aiperf, options, mode, load, url=url, tokenizer=Path(tok),
                                   prompts=prompts, out=point_dir, seed=options.seed + repeat,
                                   llmapi=llmapi)  # fmt: skip
                    timeout = POINT_TIMEOUT_S + (options.duration or 0.0)
                    figures = run_point(argv, point_dir, out.with_suffix(".aiperf.log"), timeout)
                    if count is not None:  # each response held the whole text so far
                        recount(figures, point_dir, count)
                    repeats.append(figures)
                points.append({"mode": mode, "load": load, "repeats": repeats,
                               "summary": summarize(repeats)})  # fmt: skip
        result = {
            "version": 1,
            "tools": {"trt-builder": __version__, "aiperf": aiperf.version},
            "target": target,
            "url": url,
            "serving": serving,
            "options": options.to_json(),
            "started_at": started,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "points": points,
        }
        from .report import html_page  # matplotlib: only when a page is drawn

        page = html_page([result])
        write_json(out, result)
        write_text(out.with_suffix(".html"), page)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)
