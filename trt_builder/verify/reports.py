"""The verify report (reports/verify.json) as JUnit XML for CI and as one HTML page for people.

Both mirror the report's verdict: a gate check fails when `report["failures"]` holds its text,
so they never disagree with verify.json. matplotlib is imported only when a page is drawn.
"""

from __future__ import annotations

import html
import math
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.fsio import write_text
from ..core.svg import figure_svg

SUITE = "trt-builder verify"


@dataclass(frozen=True)
class Check:
    """One gate check of a report: its JUnit name, what it measured and whether it held."""

    name: str  # the JUnit test name, e.g. "top1"
    label: str  # the words for the HTML table
    value: str
    gate: str
    failures: tuple[str, ...] = ()
    skipped: str | None = None  # why it was not gated

    @property
    def failed(self) -> bool:
        return bool(self.failures)


@dataclass(frozen=True)
class _Rule:
    name: str
    label: str
    prefixes: tuple[str, ...]  # how verify.py's failure texts for this check begin
    value_format: str
    gate_format: str


_RULES = (
    _Rule("top1", "top-1 agreement", ("top-1 agreement",), "{:.4f}", "≥ {}"),
    _Rule(
        "kl_mean",
        "mean KL(reference ‖ candidate)",
        ("mean KL", "the candidate's logits are not finite"),
        "{:.2e}",
        "≤ {:.0e}",
    ),
    _Rule(
        "perplexity_delta",
        "held-out perplexity increase",
        ("held-out perplexity", "perplexity"),
        "{:+.2f}%",
        "≤ +{}%",
    ),
    _Rule("greedy_agreement", "greedy agreement", ("greedy agreement",), "{:.3f}", "≥ {}"),
    _Rule(
        "no_empty_output",
        "prompts with empty output",
        ("empty output", "end-of-sequence ids: the output ends at once"),
        "{}",
        "= {}",
    ),
)
#: The check that holds the failures no gate check claims (fatal diagnosis findings).
FINDINGS = "fatal_findings"


def _measured(report: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """(value, gate limit) of each rule; None where not measured or not gated."""
    gate = report.get("gate") or {}
    prompts = report.get("prompts")
    return {
        "top1": (report.get("top1"), gate.get("min_top1")),
        "kl_mean": (report.get("kl_mean"), gate.get("max_kl")),
        "perplexity_delta": (
            (report.get("perplexity") or {}).get("delta_pct"),
            gate.get("max_ppl_delta_pct"),
        ),
        "greedy_agreement": (report.get("greedy_agreement"), gate.get("min_greedy")),
        "no_empty_output": (
            None if prompts is None else sum(bool(p.get("candidate_empty")) for p in prompts),
            0,
        ),
    }


def _number(value: Any, spec: str) -> str:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return spec.format(value) if ok else "n/a"


def checks(report: dict[str, Any]) -> list[Check]:
    """The gate checks of a report, each with the failure texts that name it."""
    failures = [str(f) for f in report.get("failures") or ()]
    measured = _measured(report)
    claimed: set[int] = set()
    out = []
    for rule in _RULES:
        value, limit = measured[rule.name]
        mine = [
            i for i, f in enumerate(failures) if i not in claimed and f.startswith(rule.prefixes)
        ]
        claimed.update(mine)
        skipped = "no gate set" if limit is None else "not measured" if value is None else None
        out.append(
            Check(
                rule.name,
                rule.label,
                _number(value, rule.value_format),
                "—" if limit is None else rule.gate_format.format(limit),
                tuple(failures[i] for i in mine),
                None if mine else skipped,
            )
        )
    rest = tuple(f for i, f in enumerate(failures) if i not in claimed)
    if not rest and report.get("passed") is False and not any(c.failed for c in out):
        rest = ("verify failed without naming a reason",)
    out.append(Check(FINDINGS, "fatal diagnosis findings", str(len(rest)), "= 0", rest))
    return out


def _diagnosis_lines(report: dict[str, Any]) -> list[str]:
    return [
        f"{d.get('cause', '?')}: {d.get('evidence', '')}"
        + ("" if d.get("fatal", True) else " (not fatal on its own)")
        for d in report.get("diagnosis") or ()
    ]


# -- JUnit -----------------------------------------------------------------------------------

_XML_INVALID = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _x(text: Any) -> str:
    """Text XML 1.0 can hold (model output may contain control characters)."""
    return _XML_INVALID.sub("\ufffd", str(text))


def _prompt_out(prompt: dict[str, Any]) -> str:
    keys = ("tokens", "top1", "kl_mean", "max_abs_logit_error", "greedy_match_tokens")
    lines = [f"prompt: {prompt.get('prompt', '')}"]
    lines += [
        f"{k}: {prompt[k]}" for k in (*keys, "greedy_tokens", "candidate_empty") if k in prompt
    ]
    lines += [f"reference: {prompt.get('reference_text', '')}"]
    lines += [f"candidate: {prompt.get('candidate_text', '')}"]
    return "\n".join(lines)


def junit_xml(report: dict[str, Any]) -> str:
    """The report as a JUnit XML document: a testcase per gate check and per prompt."""
    classname = f"verify.{report.get('runtime', 'unknown')}"
    diagnosis = _diagnosis_lines(report)
    found = checks(report)
    prompts = list(report.get("prompts") or ())
    counts = {
        "tests": str(len(found) + len(prompts)),
        "failures": str(sum(c.failed for c in found)),
        "errors": "0",
        "skipped": str(sum(c.skipped is not None for c in found)),
        "time": f"{float(report.get('seconds') or 0):.3f}",
    }
    root = ET.Element("testsuites", {"name": SUITE, **counts})
    suite = ET.SubElement(root, "testsuite", {"name": SUITE, **counts})
    props = ET.SubElement(suite, "properties")
    for key in ("device", "checkpoint", "reference", "checkpoint_dtype", "quant_algo"):
        ET.SubElement(props, "property", name=key, value=_x(report.get(key)))
    for check in found:
        case = ET.SubElement(suite, "testcase", classname=classname, name=check.name, time="0")
        if check.failed:
            text = "\n".join(check.failures)
            if diagnosis:
                text += "\n\nDiagnosis:\n" + "\n".join(f"- {d}" for d in diagnosis)
            failure = ET.SubElement(case, "failure", message=_x("; ".join(check.failures)))
            failure.set("type", "VerifyFailed")
            failure.text = _x(text)
        elif check.skipped:
            ET.SubElement(case, "skipped", message=check.skipped)
        ET.SubElement(case, "system-out").text = _x(
            f"{check.label}: {check.value} (gate {check.gate})"
        )
    for i, prompt in enumerate(prompts):
        case = ET.SubElement(suite, "testcase", classname=classname, name=f"prompt[{i}]", time="0")
        ET.SubElement(case, "system-out").text = _x(_prompt_out(prompt))
    summary = ["PASSED" if report.get("passed") else "FAILED", *(report.get("failures") or ())]
    if diagnosis:
        summary += ["", "Diagnosis:", *(f"- {d}" for d in diagnosis)]
    ET.SubElement(suite, "system-out").text = _x("\n".join(summary))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(report: dict[str, Any], path: Path) -> None:
    """Write the report as JUnit XML, atomically."""
    write_text(path, junit_xml(report))


# -- HTML ------------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:72em;padding:0 1em;color:#222}
.banner{padding:.8em 1.2em;border-radius:6px;color:#fff;font-size:1.4em;font-weight:600}
.pass{background:#2e7d32}.fail{background:#c62828}.skip{color:#777}
.ok{color:#2e7d32;font-weight:600}.bad{color:#c62828;font-weight:600}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ddd;padding:.3em .6em;
text-align:left;vertical-align:top}th{background:#f5f5f5}
.text td{white-space:pre-wrap;width:50%;font-family:ui-monospace,monospace;font-size:13px}
mark{background:#ffcc80}svg{max-width:100%;height:auto}.meta{color:#555}
details{margin:.4em 0}summary{cursor:pointer}
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _header(report: dict[str, Any]) -> str:
    passed = bool(report.get("passed"))
    parts = [
        f'<div class="banner {"pass" if passed else "fail"}">verify '
        f"{'PASSED' if passed else 'FAILED'}</div>"
    ]
    if report.get("failures"):
        items = "".join(f"<li>{_e(f)}</li>" for f in report["failures"])
        parts.append(f"<h2>Failures</h2><ul>{items}</ul>")
    if report.get("diagnosis"):
        rows = "".join(
            f"<tr><td>{_e(d.get('cause', ''))}</td><td>{_e(d.get('evidence', ''))}</td>"
            f"<td>{'yes' if d.get('fatal', True) else 'no'}</td></tr>"
            for d in report["diagnosis"]
        )
        parts.append(
            "<h2>Diagnosis</h2><table><tr><th>likely cause</th><th>evidence</th>"
            f"<th>fatal</th></tr>{rows}</table>"
        )
    keys = ("checkpoint", "reference", "checkpoint_dtype", "reference_dtype", "quant_algo")
    meta = [f"{k}: {_e(report.get(k))}" for k in (*keys, "runtime", "device", "seconds")]
    parts.append(f'<p class="meta">{" · ".join(meta)}</p>')
    return "\n".join(parts)


def _metrics_table(report: dict[str, Any]) -> str:
    rows = []
    for check in checks(report):
        state = (
            '<span class="bad">fail</span>'
            if check.failed
            else f'<span class="skip">skipped ({_e(check.skipped)})</span>'
            if check.skipped
            else '<span class="ok">pass</span>'
        )
        rows.append(
            f"<tr><td>{_e(check.label)}</td><td>{_e(check.value)}</td>"
            f"<td>{_e(check.gate)}</td><td>{state}</td></tr>"
        )
    ppl = report.get("perplexity") or {}
    extra = {
        "max |logit error|": _number(report.get("max_abs_logit_error"), "{:.3g}"),
        "tokens compared": _e(report.get("tokens", "n/a")),
        "perplexity reference → candidate": f"{_number(ppl.get('reference'), '{:.3f}')} → "
        f"{_number(ppl.get('candidate'), '{:.3f}')}",
    }
    rows += [f"<tr><td>{k}</td><td>{v}</td><td>—</td><td></td></tr>" for k, v in extra.items()]
    head = "<tr><th>metric</th><th>value</th><th>gate</th><th>result</th></tr>"
    return f"<h2>Metrics</h2><table>{head}{''.join(rows)}</table>"


def _positive(xs: list[Any], ys: list[Any]) -> tuple[list[float], list[float]]:
    """The points a log axis can show (positive, finite values)."""
    pairs = [
        (float(x), float(y))
        for x, y in zip(xs, ys, strict=True)
        if isinstance(y, (int, float)) and math.isfinite(y) and y > 0
    ]
    return [x for x, _ in pairs], [y for _, y in pairs]


def _plot_layers(rows: list[dict[str, Any]]) -> str:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    xs, ys = _positive([r.get("layer") for r in rows], [r.get("rel_error") for r in rows])
    fig = Figure(figsize=(8, 3.2))
    ax = fig.add_subplot()
    ax.plot(xs, ys, marker="o")
    ax.set_yscale("log")
    ax.set_xlabel("layer (last point: final norm)" if rows[-1].get("final") else "layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("relative error of hidden states")
    ax.grid(True, which="both", alpha=0.3)
    return figure_svg(fig, "by_layer")


def _plot_positions(rows: list[dict[str, Any]]) -> str:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    positions = [r.get("position") for r in rows]
    fig = Figure(figsize=(8, 4.8))
    kl_ax, top1_ax = fig.subplots(2, 1, sharex=True)
    kl_ax.plot(*_positive(positions, [r.get("kl_mean") for r in rows]))
    kl_ax.set_yscale("log")
    kl_ax.set_ylabel("mean KL")
    top1_ax.plot(positions, [r.get("top1") for r in rows], color="tab:green")
    top1_ax.set_ylabel("top-1 agreement")
    top1_ax.set_xlabel("token position")
    top1_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (kl_ax, top1_ax):
        ax.grid(True, which="both", alpha=0.3)
    return figure_svg(fig, "by_position")


def _plot_prompts(prompts: list[dict[str, Any]], min_top1: float | None) -> str:
    from matplotlib.figure import Figure

    values = [float(p.get("top1") or 0.0) for p in prompts]
    bad = [min_top1 is not None and v < min_top1 for v in values]
    fig = Figure(figsize=(8, 1 + 0.3 * len(prompts)))
    ax = fig.add_subplot()
    ax.barh(range(len(values)), values, color=["#c62828" if b else "#2e7d32" for b in bad])
    labels = [f"[{i}] {str(p.get('prompt', ''))[:40]}" for i, p in enumerate(prompts)]
    ax.set_yticks(range(len(values)), labels, parse_math=False)  # prompts may hold "$"
    ax.invert_yaxis()
    if min_top1 is not None:
        ax.axvline(min_top1, color="#555", linestyle="--", label=f"gate min_top1 {min_top1}")
        ax.legend(loc="lower right", bbox_to_anchor=(1, 1), frameon=False)  # above the bars
    ax.set_xlabel("top-1 agreement")
    return figure_svg(fig, "by_prompt")


def _plots(report: dict[str, Any]) -> str:
    prompts = report.get("prompts") or []
    min_top1 = (report.get("gate") or {}).get("min_top1")
    plots = [
        ("Error by layer", "by_layer", report.get("by_layer"), _plot_layers),
        ("Error by position", "by_position", report.get("by_position"), _plot_positions),
        ("Agreement by prompt", "prompts", prompts, lambda rows: _plot_prompts(rows, min_top1)),
    ]
    parts = []
    for title, key, rows, draw in plots:
        parts.append(f"<h2>{title}</h2>")
        if rows:
            parts.append(draw(rows))
        else:
            parts.append(f'<p class="skip">Plot skipped: the report has no {key} data.</p>')
    return "\n".join(parts)


def _marked(text: str, other: str) -> str:
    """`text` escaped, its first word that differs from `other`'s words in <mark>."""
    mine, theirs = text.split(), other.split()
    first = next((i for i, w in enumerate(mine) if i >= len(theirs) or theirs[i] != w), -1)
    out, word = [], 0
    for piece in re.findall(r"\s+|\S+", text):
        out.append(
            f"<mark>{_e(piece)}</mark>" if word == first and not piece.isspace() else _e(piece)
        )
        word += not piece.isspace()
    return "".join(out)


def _prompt_section(i: int, prompt: dict[str, Any], min_top1: float | None) -> str:
    ref, cand = str(prompt.get("reference_text", "")), str(prompt.get("candidate_text", ""))
    top1 = prompt.get("top1")
    low = min_top1 is not None and isinstance(top1, (int, float)) and top1 < min_top1
    differs = ref != cand or bool(prompt.get("candidate_empty"))
    summary = (
        f"[{i}] {_e(prompt.get('prompt', ''))} — top-1 {_number(top1, '{:.4f}')}, "
        f"KL {_number(prompt.get('kl_mean'), '{:.2e}')}, greedy "
        f"{_e(prompt.get('greedy_match_tokens', '?'))}/{_e(prompt.get('greedy_tokens', '?'))}"
        + (" — <span class='bad'>empty output</span>" if prompt.get("candidate_empty") else "")
    )
    return (
        f"<details{' open' if low or differs else ''}><summary>{summary}</summary>"
        '<table class="text"><tr><th>reference</th><th>candidate</th></tr>'
        f"<tr><td>{_marked(ref, cand)}</td><td>{_marked(cand, ref)}</td></tr></table></details>"
    )


def _recipe_table(report: dict[str, Any]) -> str:
    """The INT8 recipe search's candidates and choice (checkpoint/recipe.json), if it ran:
    each figure with its standard error over the scored windows."""
    recipe = report.get("recipe")
    if not recipe:
        return ""
    chosen = recipe.get("chosen")

    def pm(c: dict[str, Any], key: str, fmt: str) -> str:
        value, se = c.get(key), c.get(f"{key}_se")
        text = _number(value, fmt)
        return text if se is None else f"{text} ± {_number(se, fmt.replace('+', ''))}"

    rows = "".join(
        f"<tr><td>{_e(c.get('name'))}</td><td>{pm(c, 'kl', '{:.5f}')}</td>"
        f"<td>{pm(c, 'ppl_delta_pct', '{:+.2f}%')}</td>"
        f"<td>{pm(c, 'top1', '{:.4f}')}</td><td>{_e(c.get('windows'))}</td>"
        f"<td>{'chosen' if c.get('name') == chosen else ''}</td></tr>"
        for c in recipe.get("candidates") or []
    )
    return (
        f"<h2>INT8 recipe</h2><p class='meta'>{_e(recipe.get('method'))}; "
        f"{_e(recipe.get('tokens'))} search-split tokens.</p><table><tr><th>candidate</th>"
        "<th>mean KL</th><th>perplexity increase</th><th>top-1</th><th>windows</th><th></th>"
        f"</tr>{rows}</table>"
    )


def html_page(report: dict[str, Any]) -> str:
    """The report as one self-contained HTML page (inline CSS and SVG, no external URLs)."""
    min_top1 = (report.get("gate") or {}).get("min_top1")
    prompts = report.get("prompts") or []
    sections = "\n".join(_prompt_section(i, p, min_top1) for i, p in enumerate(prompts))
    state = "passed" if report.get("passed") else "FAILED"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>trt-builder verify: {state}</title><style>{_CSS}</style></head><body>\n"
        f"{_header(report)}\n{_metrics_table(report)}\n{_recipe_table(report)}\n"
        f"{_plots(report)}\n"
        "<h2>Greedy output by prompt</h2>\n<p class='meta'>The first word that differs is "
        f"highlighted.</p>\n{sections or '<p>No prompts.</p>'}\n</body></html>\n"
    )


def write_html(report: dict[str, Any], path: Path) -> None:
    """Write the report as one self-contained HTML page, atomically."""
    write_text(path, html_page(report))


def write_reports(
    report: dict[str, Any], directory: Path, *, stem: str = "verify"
) -> dict[str, Path]:
    """Write <stem>.junit.xml and <stem>.html into `directory`, next to <stem>.json."""
    paths = {"junit": directory / f"{stem}.junit.xml", "html": directory / f"{stem}.html"}
    write_junit(report, paths["junit"])
    write_html(report, paths["html"])
    return paths
