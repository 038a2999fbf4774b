"""`trt-builder`: thin commands over the library (build.py, serving.py, fleet.py, info.py);
every error becomes one line and a documented exit code, here."""

from __future__ import annotations

import json
import sys
import traceback

import click
from rich.markup import escape

from ..core.errors import TrtBuilderError, library_error
from . import build, fleet, info, options, serving  # noqa: F401  (each registers its commands)
from .app import cli, err

__all__ = ["cli", "main"]


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
