"""The command group, its one stderr console, and what the commands share: the spec from their
options and the run of the pipeline's stages (the commands are in build.py, serving.py,
fleet.py and info.py; main.py maps errors to messages)."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console

from .. import __version__
from ..core.errors import EXIT_CODES, VerifyFailed
from ..pipeline.build import BuildResult, run
from ..spec.build import load_toml, make_spec
from . import options
from .render import StageProgress, summary

err = Console(stderr=True, highlight=False)

EPILOG_EXIT = "\b\nExit codes:\n" + "\n".join(
    f"  {code:>3}  {text}" for code, text in EXIT_CODES.items()
)


def spec_from(kwargs: dict[str, Any]) -> Any:
    config = kwargs.pop("config", None)
    toml = load_toml(config) if config else None
    return make_spec(
        toml, **{key: kwargs.pop(param, None) for param, key in options.SPEC_KEYS.items()}
    )


def run_stages(stages: tuple[str, ...], kwargs: dict[str, Any]) -> None:
    as_json = kwargs.pop("as_json")
    force, dry_run, lock_timeout = (
        kwargs.pop("force"),
        kwargs.pop("dry_run"),
        kwargs.pop("lock_timeout"),
    )
    spec = spec_from(kwargs)
    progress = None if as_json else StageProgress(err)
    result = run(spec, only=stages, force=force, dry_run=dry_run, lock_timeout=lock_timeout,
                 listener=progress, check=False)  # fmt: skip
    if result.error is not None and not isinstance(result.error, VerifyFailed):
        raise result.error  # one line on stderr (and {"ok": false} with --json)
    report(result, as_json, ok=result.error is None)
    if result.error is not None:
        raise result.error


def report(result: BuildResult, as_json: bool, *, ok: bool) -> None:
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
