"""`trt-builder nightly`: rebuild a fleet, verify it, and compare it with the last good run.

For each entry of the fleet file: resolve the model's upstream revision (the hub when online,
the pin or the last run's commit offline), run the pipeline (a stage reruns only when its key
changed), read the verify figures, and compare them with the entry's last good run in the
history (a JSON file kept beside the engines). The run fails when an entry fails its gates,
errors, or got worse than its tolerance. Reports: nightly.json, nightly.junit.xml and
nightly.md (for a CI job summary). docs/nightly.md describes all of it.
"""

from __future__ import annotations

import math
import os
import secrets
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import __version__
from ..core.errors import (
    HubUnreachable,
    InputError,
    NightlyFailed,
    OutputError,
    SpecError,
    TrtBuilderError,
    VerifyFailed,
)
from ..core.fsio import write_json
from ..core.versions import tool_versions
from ..pipeline import build as pipeline
from ..pipeline.build import STAGE_NAMES, BuildResult
from ..source.hub import hub_offline, resolve_hub_revision
from .file import BENCH_FIGURES, METRICS, Entry, Fleet, Metric, Tolerance, tolerance_for

HISTORY_VERSION = 1
#: Stage statuses that mean nothing was rebuilt.
_UNCHANGED = ("cached", "cached-failed", "skipped")


@dataclass(frozen=True)
class Revision:
    """A model's revision for this run, and where it came from."""

    model_id: str
    requested: str | None  # the fleet's branch, tag or sha (None: a local path or the default)
    sha: str | None  # the commit built (None: local content decides, in the pipeline)
    source: str  # fixed | hub | pin | history | cache | content
    note: str | None = None  # e.g. the hub was unreachable and the pin was built

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Regression:
    metric: Metric
    old: float
    new: float
    allowed: float
    tolerance: Tolerance

    def text(self, entry: Entry, baseline: dict[str, Any]) -> str:
        m = self.metric
        return (
            f"{entry.id}: {m.name} ({m.label}) regressed from {m.fmt.format(self.old)} to "
            f"{m.fmt.format(self.new)}, more than the {self.allowed:.3g} allowed (model "
            f"{entry.model or 'the embedded default'}; last good run {baseline['run_id']})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "metric": self.metric.name,
            "old": self.old,
            "new": self.new if math.isfinite(self.new) else None,
            "allowed": self.allowed,
            "tolerance": {"absolute": self.tolerance.absolute, "relative": self.tolerance.relative},
        }


@dataclass
class EntryResult:
    """What the nightly did with one entry."""

    entry: Entry
    status: str = "error"  # passed | failed (a gate) | regressed | error
    message: str | None = None
    revision: str | None = None
    previous_revision: str | None = None
    fingerprint: str | None = None
    stages: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float | None] = field(default_factory=dict)
    baseline: dict[str, Any] | None = None
    regressions: list[Regression] = field(default_factory=list)
    accepted: bool = False
    notices: list[str] = field(default_factory=list)
    paths: dict[str, str] = field(default_factory=dict)
    exit_code: int = 0
    seconds: float = 0.0
    hashed_bytes: int = 0  # bytes read to digest inputs: 0 when nothing changed
    bench_served_by: str | None = None  # what served the bench's repository (bench/report.py)
    traceback: str | None = None  # an unexpected error's, for the report

    @property
    def rebuilt(self) -> list[str]:
        return [name for name, status in self.stages.items() if status not in _UNCHANGED]

    @property
    def good(self) -> bool:
        return self.status == "passed"

    @property
    def regression_messages(self) -> list[str]:
        assert self.baseline is not None or not self.regressions
        return [r.text(self.entry, self.baseline or {}) for r in self.regressions]

    @property
    def problems(self) -> list[str]:
        """One line for each thing wrong with this entry (its regressions, or its error)."""
        return self.regression_messages or [f"{self.entry.id}: {self.message or self.status}"]

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.entry.id,
            "model": self.entry.model_id,
            "model_ref": self.entry.model,
            "variant": self.entry.name,
            "status": self.status,
            "message": self.message,
            "revision": self.revision,
            "previous_revision": self.previous_revision,
            "fingerprint": self.fingerprint,
            "stages": self.stages,
            "rebuilt": self.rebuilt,
            "metrics": _finite(self.metrics),
            "baseline": self.baseline,
            "regressions": [r.to_json() for r in self.regressions],
            "regression_messages": self.regression_messages,
            "accepted": self.accepted,
            "notices": self.notices,
            "paths": self.paths,
            "bench_served_by": self.bench_served_by,
            "exit_code": self.exit_code,
            "seconds": round(self.seconds, 3),
            "hashed_bytes": self.hashed_bytes,
            "traceback": self.traceback,
        }


@dataclass
class NightlyResult:
    fleet: Fleet
    run_id: str
    started_at: str  # UTC, ISO 8601 with Z
    offline: bool
    revisions: dict[str, Revision] = field(default_factory=dict)
    entries: list[EntryResult] = field(default_factory=list)
    seconds: float = 0.0
    history_error: str | None = None

    @property
    def ok(self) -> bool:
        return all(e.good for e in self.entries)

    def counts(self) -> dict[str, int]:
        out = {"passed": 0, "failed": 0, "regressed": 0, "error": 0}
        for e in self.entries:
            out[e.status] = out.get(e.status, 0) + 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "fleet": self.fleet.name,
            "fleet_file": str(self.fleet.path),
            "run_id": self.run_id,
            "started_at": self.started_at,
            "seconds": round(self.seconds, 3),
            "offline": self.offline,
            "trt_builder": __version__,
            "counts": self.counts(),
            "revisions": {k: v.to_json() for k, v in self.revisions.items()},
            "entries": [e.to_json() for e in self.entries],
            "history": str(self.fleet.history),
            "history_error": self.history_error,
        }


# -- history -----------------------------------------------------------------------------------


class History:
    """The fleet's past runs (newest last), kept as one JSON file beside the engines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.runs: list[dict[str, Any]] = self._read()

    def _read(self) -> list[dict[str, Any]]:
        import json

        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            raise InputError(
                f"the nightly history {self.path} is unreadable ({exc}): restore it from the "
                "engines cache, or move it away to start a new baseline"
            ) from None
        if not isinstance(data, dict) or data.get("history_version") != HISTORY_VERSION:
            raise InputError(
                f"{self.path} is not a trt-builder nightly history (version {HISTORY_VERSION}): "
                "set [fleet] history to another path"
            )
        return list(data.get("runs") or [])

    def last_good(self, entry_id: str, fingerprint: str) -> dict[str, Any] | None:
        """The newest run in which this entry, built as it is specified now, passed."""
        for run in reversed(self.runs):
            e = (run.get("entries") or {}).get(entry_id)
            if e and e.get("status") == "passed" and e.get("fingerprint") == fingerprint:
                return {
                    "run_id": run["run_id"],
                    "finished_at": run.get("finished_at"),
                    "revision": e.get("revision"),
                    "metrics": e.get("metrics") or {},
                }
        return None

    def last_revision(self, entry_ids: list[str]) -> str | None:
        """The newest revision built for any of these entries (one model's)."""
        for run in reversed(self.runs):
            for entry_id in entry_ids:
                e = (run.get("entries") or {}).get(entry_id)
                if e and e.get("revision"):
                    return str(e["revision"])
        return None

    def referenced(self, entry_id: str) -> set[str]:
        """Revisions this entry was last built at and last passed at (what gc keeps)."""
        out: set[str] = set()
        latest = self.last_revision([entry_id])
        if latest:
            out.add(latest)
        for run in reversed(self.runs):
            e = (run.get("entries") or {}).get(entry_id)
            if e and e.get("status") == "passed" and e.get("revision"):
                out.add(str(e["revision"]))
                break
        return out

    def append(self, run: dict[str, Any], keep: int) -> None:
        """Add a run under a lock, merged with what other jobs wrote since we read it."""
        from filelock import FileLock

        self.path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.path) + ".lock"):
            self.runs = _trim([*self._read(), run], keep)
            write_json(self.path, {"history_version": HISTORY_VERSION, "runs": self.runs})


def _trim(runs: list[dict[str, Any]], keep: int) -> list[dict[str, Any]]:
    """The newest `keep` runs, and older ones still holding an entry's newest good run (its
    baseline): an entry that keeps regressing must not lose what it is compared with."""
    kept = set(range(max(0, len(runs) - keep), len(runs)))
    found: set[tuple[str, Any]] = set()
    for i in range(len(runs) - 1, -1, -1):
        for entry_id, e in (runs[i].get("entries") or {}).items():
            if e.get("status") == "passed" and (entry_id, e.get("fingerprint")) not in found:
                found.add((entry_id, e.get("fingerprint")))
                kept.add(i)
    return [run for i, run in enumerate(runs) if i in kept]


# -- revisions ---------------------------------------------------------------------------------

Resolver = Callable[[str, str], str]


def _hub_resolver(repo_id: str, revision: str) -> str:

    return resolve_hub_revision(repo_id, revision)


def _offline_sha(entry: Entry, history: History, ids: list[str], why: str | None) -> Revision:
    """Offline (or with the hub unreachable): the pin, else the last run's commit, else the
    local HF cache's ref."""
    if entry.pin:
        return Revision(entry.model_id, entry.revision, entry.pin, "pin", why)
    last = history.last_revision(ids)
    if last:
        return Revision(entry.model_id, entry.revision, last, "history", why)

    try:
        sha = resolve_hub_revision(str(entry.model), entry.revision, offline=True)
    except InputError as exc:
        raise InputError(
            f'{entry.model_id}: no revision to build offline ({exc}); add pin = "<commit sha>" '
            "to its [[models]] entry, or run the nightly online once"
        ) from None
    return Revision(entry.model_id, entry.revision, sha, "cache", why)


def resolve_revisions(
    fleet: Fleet,
    entries: tuple[Entry, ...],
    history: History,
    *,
    offline: bool,
    resolver: Resolver = _hub_resolver,
) -> dict[str, Revision | TrtBuilderError]:
    """Each model's revision for this run (or the error that keeps its entries from running)."""
    out: dict[str, Revision | TrtBuilderError] = {}
    for entry in entries:
        if entry.model_id in out:
            continue
        ids = [e.id for e in fleet.entries if e.model_id == entry.model_id]
        try:
            out[entry.model_id] = _resolve_one(entry, history, ids, offline, resolver)
        except TrtBuilderError as exc:
            out[entry.model_id] = exc
    return out


def _resolve_one(
    entry: Entry, history: History, ids: list[str], offline: bool, resolver: Resolver
) -> Revision:
    if not entry.hub:
        return Revision(entry.model_id, None, None, "content")
    assert entry.revision is not None
    if len(entry.revision) == 40 and all(c in "0123456789abcdef" for c in entry.revision):
        return Revision(entry.model_id, entry.revision, entry.revision, "fixed")
    if offline:
        return _offline_sha(entry, history, ids, None)
    try:
        return Revision(entry.model_id, entry.revision, resolver(str(entry.model), entry.revision),
                        "hub")  # fmt: skip
    except HubUnreachable as exc:
        fallback = _offline_sha(entry, history, ids, None)
        note = (f"the hub was unreachable ({exc}): built the {fallback.source} revision "
                f"{str(fallback.sha)[:12]}; upstream was not checked")  # fmt: skip
        return Revision(fallback.model_id, fallback.requested, fallback.sha, fallback.source, note)


# -- comparing ---------------------------------------------------------------------------------


def _finite(metrics: dict[str, float | None]) -> dict[str, float | None]:
    """For JSON: a non-finite figure (NaN, inf) is written as null."""
    return {k: (v if v is not None and math.isfinite(v) else None) for k, v in metrics.items()}


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def compare(
    metrics: dict[str, Any],
    baseline: dict[str, Any],
    tolerances: dict[str, Tolerance],
    tracked: tuple[Metric, ...] = METRICS,
) -> list[Regression]:
    """The metrics of `tracked` that got worse than the baseline by more than their tolerance."""
    out = []
    for metric in tracked:
        old, new = _number(baseline.get(metric.name)), _number(metrics.get(metric.name))
        if old is None or new is None or not math.isfinite(old):
            continue
        tol = tolerance_for(tolerances, metric.name)
        allowed = tol.allowed(old)
        worse = (old - new) if metric.higher_is_better else (new - old)
        if not math.isfinite(new) or worse > allowed + 1e-12:
            out.append(Regression(metric, old, new, allowed, tol))
    return out


# -- running -----------------------------------------------------------------------------------


def _new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(2)


EntryListener = Callable[[str, int, int, EntryResult], None]


def run_nightly(
    fleet: Fleet,
    *,
    select: tuple[str, ...] = (),
    offline: bool | None = None,
    accept: tuple[str, ...] = (),
    lock_timeout: float = 600.0,
    listener: Any = None,
    on_entry: EntryListener | None = None,
    resolver: Resolver = _hub_resolver,
) -> NightlyResult:
    """Rebuild, verify and compare the selected entries; record the run in the history.

    `accept` names entries (or models) whose regressions are accepted: the run records their
    figures as the new baseline. `listener` gets the pipeline's stage events; `on_entry` gets
    ("start" | "end", index, count, result)."""
    start = time.perf_counter()
    entries = fleet.select(select)
    for name in accept:
        if not any(name in (e.id, e.model_id) for e in entries):
            raise SpecError(
                f"--accept {name} names no entry this run builds: add it with --entry, or name "
                "one of: " + ", ".join(e.id for e in entries)
            )
    accepted_ids = {e.id for e in entries if e.id in accept or e.model_id in accept}

    offline = hub_offline() if offline is None else offline
    history = History(fleet.history)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    result = NightlyResult(fleet, _new_run_id(), started, offline)
    revisions = resolve_revisions(fleet, entries, history, offline=offline, resolver=resolver)
    result.revisions = {k: v for k, v in revisions.items() if isinstance(v, Revision)}
    tell = on_entry or (lambda *_: None)
    for i, entry in enumerate(entries):
        er = EntryResult(entry)
        tell("start", i, len(entries), er)
        t0 = time.perf_counter()
        revision = revisions[entry.model_id]
        if isinstance(revision, TrtBuilderError):
            er.message, er.exit_code = str(revision), revision.exit_code
        else:
            # an offline night fetches from the local HF cache, and so does one whose revision
            # came from a fallback (the hub was down); otherwise HF_HUB_OFFLINE decides
            fetch_offline = True if offline or revision.note else None
            _run_entry(er, revision, history, lock_timeout, listener, fetch_offline)
            if revision.note:
                er.notices.append(revision.note)
            if er.regressions and entry.id in accepted_ids:
                er.accepted, er.status, er.exit_code = True, "passed", 0
                er.notices.append("regressions accepted (--accept): this run is the new baseline")
        er.seconds = time.perf_counter() - t0
        result.entries.append(er)
        tell("end", i, len(entries), er)
    result.seconds = time.perf_counter() - start
    try:
        history.append(_history_record(result), fleet.keep_runs)
    except OSError as exc:  # the reports are still written; the CLI then fails (exit 10)
        result.history_error = (
            f"cannot write the nightly history {fleet.history} ({exc.strerror or exc}): free disk "
            "space or fix its permissions; this run is not recorded"
        )
    return result


def _run_entry(
    er: EntryResult,
    revision: Revision,
    history: History,
    lock_timeout: float,
    listener: Any,
    offline: bool | None,
) -> None:
    entry = er.entry
    spec = entry.spec(revision.sha)
    er.fingerprint = entry.fingerprint(spec)
    er.previous_revision = history.last_revision([entry.id])
    build: BuildResult | None = None
    try:
        build = pipeline.run(spec, only=STAGE_NAMES, lock_timeout=lock_timeout, listener=listener,
                    offline=offline, check=False)  # fmt: skip
    except TrtBuilderError as exc:  # before any stage ran: resolving the source, the early checks
        er.status, er.message, er.exit_code = "error", str(exc), exc.exit_code
    except Exception as exc:  # a bug in one entry must not hide the others' results
        er.status, er.exit_code = "error", 1
        er.message = f"internal error: {type(exc).__name__}: {exc} (please report it)"
        er.traceback = traceback.format_exc()
    if build is not None:
        error = build.error  # e.g. the engine failed: what ran before it still counts
        if error is None:
            er.status = "passed"
        else:
            er.status = "failed" if isinstance(error, VerifyFailed) else "error"
            er.message, er.exit_code = str(error), error.exit_code
    if build is None:
        return
    layout = build.layout
    er.revision = layout.revision
    er.paths = {
        "variant_dir": str(layout.variant_dir),
        "verify_report": str(layout.reports / "verify.html"),
        "triton_repository": str(layout.triton),
    }
    er.notices.extend(n for n in build.notices if n not in er.notices)
    er.stages = {r.name: r.status for r in build.records}
    er.hashed_bytes = build.hashed_bytes
    engine = next((r for r in build.records if r.name == "engine"), None)
    if engine is not None and engine.status == "skipped":
        er.notices.append(f"engine {engine.details.get('reason', 'skipped')}")
    verify = next((r for r in build.records if r.name == "verify"), None)
    if verify is not None:
        er.metrics = {m.name: _number(verify.details.get(m.name)) for m in METRICS}
    if er.status == "passed" and entry.bench is not None:
        # beside the stages' outputs, never in one (an edited output is not a cache hit)
        _bench(er, layout.triton, layout.variant_dir / "bench" / "bench.json")
    if er.status != "passed":
        return
    baseline = history.last_good(entry.id, er.fingerprint)
    if baseline is None:
        er.notices.append(
            "no earlier good run of this entry as it is specified now: this run is its baseline"
        )
        return
    er.baseline = baseline
    er.regressions = compare(er.metrics, baseline["metrics"], entry.tolerances, entry.metrics)
    if er.regressions:
        er.status, er.exit_code = "regressed", NightlyFailed.exit_code
        er.message = "; ".join(er.regression_messages)


def _bench(er: EntryResult, repository: Path, out: Path) -> None:
    """Load-test the entry's repository (served for it); its figures join the metrics. An
    error ends the entry as one (the build itself passed)."""
    from ..bench.report import served_by
    from ..bench.run import bench

    assert er.entry.bench is not None
    try:
        result = bench(str(repository), er.entry.bench, out)
    except TrtBuilderError as exc:
        er.status, er.message, er.exit_code = "error", f"bench: {exc}", exc.exit_code
        return
    er.paths["bench_report"] = str(out.with_suffix(".html"))
    er.bench_served_by = served_by(result)
    for point in result["points"]:
        summary, at = point["summary"], f"bench.{point['mode']}{point['load']:g}"
        for key, *_ in BENCH_FIGURES:
            er.metrics[f"{at}.{key}"] = summary[key]["mean"]


def _history_record(result: NightlyResult) -> dict[str, Any]:

    return {
        "run_id": result.run_id,
        "started_at": result.started_at,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": os.uname().nodename if hasattr(os, "uname") else "",
        "ok": result.ok,
        "trt_builder": __version__,
        "tools": tool_versions(("torch", "transformers", "tensorrt-llm")),
        "entries": {
            e.entry.id: {
                "status": e.status,
                "model": e.entry.model_id,
                "revision": e.revision,
                "fingerprint": e.fingerprint,
                "metrics": _finite(e.metrics),
                "rebuilt": e.rebuilt,
                "accepted": e.accepted,
            }
            for e in result.entries
        },
    }


def failure_message(result: NightlyResult, summary: Path | None) -> str:
    """One line for the CLI: how many entries failed and the first reasons."""
    bad = [e for e in result.entries if not e.good]
    problems = [text for e in bad for text in e.problems]
    reasons = "; ".join(problems[:3])
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    where = f" (summary: {summary})" if summary else ""
    return f"nightly: {len(bad)} of {len(result.entries)} entries not good: {reasons}{more}{where}"


def check(result: NightlyResult, summary: Path | None = None) -> None:
    """Raise what the run's exit code says: a bad entry (11), else an unrecorded run (10)."""
    if not result.ok:
        message = failure_message(result, summary)
        if result.history_error:
            message += f"; and {result.history_error}"
        raise NightlyFailed(message)
    if result.history_error:
        raise OutputError(result.history_error)
