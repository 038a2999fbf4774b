"""The nightly run as nightly.json, JUnit XML (a suite an entry) and Markdown for a CI summary."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from ..core.fsio import write_json, write_text
from ..verify.reports import _x
from .file import BENCH_FIGURES, METRICS
from .nightly import EntryResult, NightlyResult

SUITES = "trt-builder nightly"
_ICON = {"passed": "✅", "failed": "❌", "regressed": "📉", "error": "💥"}


def _cell(entry: EntryResult, name: str) -> str:
    metric = next(m for m in entry.entry.metrics if m.name == name)
    value = entry.metrics.get(name)
    if value is None:
        return "–"
    text = metric.fmt.format(value)
    old = (entry.baseline or {}).get("metrics", {}).get(name)
    if any(r.metric.name == name for r in entry.regressions):
        return f"**{text}** (was {metric.fmt.format(old)})"
    return text


def _rebuilt(entry: EntryResult) -> str:
    if not entry.stages:
        return "–"
    return ", ".join(entry.rebuilt) if entry.rebuilt else "nothing (cached)"


def _short(revision: str | None) -> str:
    if not revision:
        return "–"
    return revision[:19] if revision.startswith("sha256-") else revision[:12]


def markdown(result: NightlyResult) -> str:
    """A summary for people (and `$GITHUB_STEP_SUMMARY`): verdict, a row an entry, then what
    went wrong and which revisions moved."""
    counts = result.counts()
    verdict = "✅ all good" if result.ok else "❌ not good"
    lines = [
        f"## trt-builder nightly `{result.fleet.name}`: {verdict}",
        "",
        f"{len(result.entries)} entries: {counts['passed']} passed, {counts['failed']} failed a "
        f"gate, {counts['regressed']} regressed, {counts['error']} errored · run "
        f"`{result.run_id}` · {result.seconds:.1f} s" + (" · offline" if result.offline else ""),
        "",
        "| entry | revision | status | rebuilt | top-1 | KL | ppl Δ % | greedy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in result.entries:
        status = f"{_ICON.get(e.status, '')} {e.status}" + (" (accepted)" if e.accepted else "")
        lines.append(
            f"| `{e.entry.id}` | `{_short(e.revision)}` | {status} | {_rebuilt(e)} | "
            + " | ".join(_cell(e, m.name) for m in METRICS)
            + " |"
        )
    lines += _bench_table(result)
    problems = [e for e in result.entries if not e.good or e.accepted]
    if problems:
        lines += ["", "### What went wrong", ""]
        for e in problems:
            for text in e.problems:
                lines.append(f"- {text.replace('|', '/')}")
            if e.paths.get("verify_report"):
                lines.append(f"  - verify report: `{e.paths['verify_report']}`")
    moved = [e for e in result.entries
             if e.revision and e.previous_revision and e.revision != e.previous_revision]  # fmt: skip
    notes = [(e.entry.id, n) for e in result.entries for n in e.notices]
    if moved or notes:
        lines += ["", "### Notes", ""]
        for e in moved:
            lines.append(
                f"- `{e.entry.id}`: revision moved `{_short(e.previous_revision)}` → "
                f"`{_short(e.revision)}`"
            )
        for entry_id, note in notes:
            lines.append(f"- `{entry_id}`: {note}")
    return "\n".join(lines) + "\n"


def _bench_table(result: NightlyResult) -> list[str]:
    """The bench figures, a row an entry and load point, and what served them."""
    benched = [e for e in result.entries if e.bench_served_by is not None]
    if not benched:
        return []
    lines = ["", "### Load (trt-builder bench)", "",
             "| entry | what served it | load | output tokens/s | requests/s | TTFT p50 (ms) | "
             "ITL p50 (ms) | errors |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for e in benched:
        assert e.entry.bench is not None
        for mode, load in e.entry.bench.points():
            at = f"bench.{mode}{load:g}"
            cells = " | ".join(_cell(e, f"{at}.{key}") for key, *_ in BENCH_FIGURES)
            lines.append(f"| `{e.entry.id}` | {e.bench_served_by} | {mode} {load:g} | {cells} |")
    return lines


def junit_xml(result: NightlyResult) -> str:
    """A testsuite an entry with testcases `build`, `gates` and `regression.<metric>`: a build
    that could not run is an error, a failed gate or a regression a failure, a metric with
    nothing to compare with is skipped."""
    total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    root = ET.Element("testsuites", {"name": SUITES})
    for e in result.entries:
        for key, value in _entry_suite(root, e, result).items():
            total[key] += value
    for key, value in total.items():
        root.set(key, str(value))
    root.set("time", f"{result.seconds:.3f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _entry_suite(root: ET.Element, e: EntryResult, result: NightlyResult) -> dict[str, int]:
    suite = ET.SubElement(root, "testsuite", {"name": e.entry.id,  # JUnit: no time zone
                                              "timestamp": result.started_at.rstrip("Z")})  # fmt: skip
    props = ET.SubElement(suite, "properties")
    for key, value in (("model", e.entry.model or "the embedded default"),
                       ("revision", e.revision or ""), ("run_id", result.run_id),
                       ("rebuilt", ",".join(e.rebuilt))):  # fmt: skip
        ET.SubElement(props, "property", name=key, value=_x(value))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    classname = f"nightly.{e.entry.id}"

    def case(name: str, seconds: float = 0.0) -> ET.Element:
        counts["tests"] += 1
        return ET.SubElement(suite, "testcase", classname=classname, name=name,
                             time=f"{seconds:.3f}")  # fmt: skip

    build = case("build", e.seconds)
    if e.status == "error":
        counts["errors"] += 1
        err = ET.SubElement(build, "error", message=_x(e.message or "error"), type="BuildError")
        err.text = _x(e.traceback or e.message or "")
    ET.SubElement(build, "system-out").text = _x(
        "stages: " + ", ".join(f"{k} {v}" for k, v in e.stages.items())
        + "".join(f"\nnote: {n}" for n in e.notices)
    )  # fmt: skip
    gates = case("gates")
    if e.status == "failed":
        counts["failures"] += 1
        fail = ET.SubElement(gates, "failure", message=_x(e.message or "failed"), type="VerifyFailed")  # fmt: skip
        fail.text = _x(e.message or "")
    elif e.status == "error" and not e.metrics:
        counts["skipped"] += 1
        ET.SubElement(gates, "skipped", message="the build did not reach verify")
    for metric in e.entry.metrics:
        mc = case(f"regression.{metric.name}")
        hit = next((r for r in e.regressions if r.metric.name == metric.name), None)
        new = e.metrics.get(metric.name)
        if hit is not None and not e.accepted:
            counts["failures"] += 1
            assert e.baseline is not None
            text = hit.text(e.entry, e.baseline)
            fail = ET.SubElement(mc, "failure", message=_x(text), type="Regression")
            fail.text = _x(text)
        elif e.baseline is None or new is None:
            counts["skipped"] += 1
            why = "not measured" if new is None else "no earlier good run to compare with"
            ET.SubElement(mc, "skipped", message=why)
        else:
            old = e.baseline["metrics"].get(metric.name)
            ET.SubElement(mc, "system-out").text = _x(
                f"{metric.label}: {new} (last good {old}, run {e.baseline['run_id']})"
            )
    for key, count in counts.items():
        suite.set(key, str(count))
    suite.set("time", f"{e.seconds:.3f}")
    return counts


def write_reports(result: NightlyResult, directory: Path) -> dict[str, Path]:
    """nightly.json, nightly.junit.xml and nightly.md in `directory` (each written atomically)."""
    paths = {
        "json": directory / "nightly.json",
        "junit": directory / "nightly.junit.xml",
        "markdown": directory / "nightly.md",
    }
    data: dict[str, Any] = result.to_json()
    write_json(paths["json"], data)
    write_text(paths["junit"], junit_xml(result))
    write_text(paths["markdown"], markdown(result))
    return paths
