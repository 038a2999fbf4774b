"""Fleets: nightly rebuilds and gc."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.markup import escape

from . import options
from .app import EPILOG_EXIT, cli, err
from .render import StageProgress


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
@options.LOCK_TIMEOUT
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
