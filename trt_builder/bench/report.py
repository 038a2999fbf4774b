"""A bench's HTML page: the throughput-latency curve, the time-to-first-token distribution,
and a table a person would rather look at than read; with two results, a comparison. Drawn
from the result JSON alone (what the page shows is what the file holds)."""

from __future__ import annotations

import html
from typing import Any

from ..core.svg import figure_svg
from .compare import compare

STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:14px}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}th{background:#f2f2f2}
td.l,th.l{text-align:left}.bad{background:#ffcdd2}.good{background:#c8e6c9}
.meta{color:#555;font-size:13px}svg{max-width:100%;height:auto}"""


def _e(text: Any) -> str:
    return html.escape(str(text))


def _n(x: Any, spec: str = ".0f") -> str:
    return "–" if x is None else format(float(x), spec)


def served_by(result: dict[str, Any]) -> str:
    """What served the tensorrt_llm model, as the deployment says: the reference backend's
    figures are a PyTorch reference's, not TensorRT-LLM's, and the page says so."""
    serving = result.get("serving") or {}
    if serving.get("implementation"):
        return f"served by the {serving['implementation']}"
    return f"tensorrt_llm on the {serving.get('backend') or 'unknown'} backend"


def _label(result: dict[str, Any], i: int) -> str:
    return f"{'AB'[i] if i < 2 else i}: {result['target']}"


def _curve(results: list[dict[str, Any]]) -> str:
    """Output tokens/s against p50 end-to-end latency and p50 time to first token, a line per
    result and mode, each point labelled with its load."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    axes = fig.subplots(1, 2)
    for i, result in enumerate(results):
        for mode in ("concurrency", "rate"):
            points = [p for p in result["points"] if p["mode"] == mode]
            if not points:
                continue
            xs = [p["summary"]["output_token_throughput"]["mean"] or 0 for p in points]
            for ax, metric, name in ((axes[0], "e2e_ms.p50", "end-to-end latency p50 (ms)"),
                                     (axes[1], "ttft_ms.p50", "time to first token p50 (ms)")):  # fmt: skip
                ys = [p["summary"][metric]["mean"] or 0 for p in points]
                ax.plot(xs, ys, marker="o", label=f"{_label(result, i)} ({mode})")
                for x, y, p in zip(xs, ys, points, strict=True):
                    ax.annotate(f"{p['load']:g}", (x, y), textcoords="offset points",
                                xytext=(4, 4), fontsize=8)  # fmt: skip
                ax.set_xlabel("output tokens/s")
                ax.set_ylabel(name)
                ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, bbox_to_anchor=(0.5, -0.12))
    fig.suptitle("throughput against latency (labels: concurrency or requests/s)")
    return figure_svg(fig, "curve")


def _ttft_distribution(result: dict[str, Any]) -> str:
    """The cumulative distribution of time to first token at each point (every repeat)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.5))
    ax = fig.subplots()
    for p in result["points"]:
        samples = sorted(x for r in p["repeats"] for x in r.get("ttft_samples_ms", []))
        if samples:
            ys = [(k + 1) / len(samples) for k in range(len(samples))]
            ax.step(samples, ys, where="post", label=f"{p['mode']} {p['load']:g}")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return figure_svg(fig, "ttft")


def _spread(s: dict[str, Any], spec: str) -> str:
    if s["std"] is None:
        return _n(s["mean"], spec)
    return f"{_n(s['mean'], spec)} ± {_n(s['std'], spec)}"


def _table(result: dict[str, Any]) -> str:
    head = ("<tr><th class=l>load</th><th>requests/s</th><th>output tokens/s</th>"
            "<th>TTFT p50</th><th>p90</th><th>p99</th><th>ITL p50</th><th>p90</th><th>p99</th>"
            "<th>E2E p50</th><th>p90</th><th>p99</th><th>errors / requests</th></tr>")  # fmt: skip
    rows = []
    for p in result["points"]:
        s, runs = p["summary"], p["repeats"]
        pct = {k: [r[k.split(".")[0]][k.split(".")[1]] for r in runs] for k in
               ("ttft_ms.p90", "itl_ms.p90", "e2e_ms.p90")}  # fmt: skip
        mean = {k: (sum(v) / len(v) if v and None not in v else None) for k, v in pct.items()}
        errors = sum(int(r["errors"]) for r in runs)
        requests = sum(int(r["requests"]) for r in runs)
        cells = [
            _spread(s["request_throughput"], ".2f"), _spread(s["output_token_throughput"], ".1f"),
            _spread(s["ttft_ms.p50"], ".0f"), _n(mean["ttft_ms.p90"]), _spread(s["ttft_ms.p99"], ".0f"),
            _spread(s["itl_ms.p50"], ".1f"), _n(mean["itl_ms.p90"], ".1f"), _spread(s["itl_ms.p99"], ".1f"),
            _spread(s["e2e_ms.p50"], ".0f"), _n(mean["e2e_ms.p90"]), _spread(s["e2e_ms.p99"], ".0f"),
        ]  # fmt: skip
        bad = " class=bad" if errors else ""
        load = f"{p['mode']} {p['load']:g}" + (f" ({len(runs)} runs)" if len(runs) > 1 else "")
        rows.append(f"<tr><td class=l>{_e(load)}</td>" + "".join(f"<td>{_e(c)}</td>" for c in cells)
                    + f"<td{bad}>{errors} / {requests}</td></tr>")  # fmt: skip
    return f"<table>{head}{''.join(rows)}</table><p class=meta>latencies in ms; ± one standard deviation over the runs</p>"


def _comparison(a: dict[str, Any], b: dict[str, Any]) -> str:
    rows = []
    for row in compare(a, b):
        cls = {"better": " class=good", "worse": " class=bad"}.get(row["verdict"], "")
        rows.append(
            f"<tr><td class=l>{_e(row['mode'])} {row['load']:g}</td><td class=l>{_e(row['metric'])}</td>"
            f"<td>{_n(row['a'], '.2f')}</td><td>{_n(row['b'], '.2f')}</td>"
            f"<td>{_n(row['ratio'], '.3f')}</td><td class=l{cls}>{_e(row['verdict'])}</td></tr>"
        )
    head = ("<tr><th class=l>load</th><th class=l>metric</th><th>A</th><th>B</th><th>B / A</th>"
            "<th class=l>B against A</th></tr>")  # fmt: skip
    return f"<h2>B against A</h2><table>{head}{''.join(rows)}</table>"


def recounted(result: dict[str, Any]) -> str:
    """What the page says of a cumulative stream's token figures (bench/cumulative.py): the
    tokens counted once, and what aiperf counted."""
    runs = [r for p in result["points"] for r in p["repeats"] if "aiperf_output_tokens" in r]
    if not runs:
        return ""
    ours, theirs = (
        sum(r["output_tokens"] for r in runs),
        sum(r["aiperf_output_tokens"] for r in runs),
    )
    return (f"; each streamed response held the whole text so far: {ours} output tokens counted "
            f"once (aiperf added up {theirs}), inter-token latency and tokens/s from them")  # fmt: skip


def html_page(results: list[dict[str, Any]]) -> str:
    """The page of one result, or of two side by side (A first)."""
    parts = [f"<!doctype html><html><head><meta charset=utf-8><title>trt-builder bench</title>"
             f"<style>{STYLE}</style></head><body><h1>trt-builder bench</h1>"]  # fmt: skip
    for i, result in enumerate(results):
        o = result["options"]
        prompts = (f"synthetic, {o['input_tokens']} tokens in" if o["prompts"] == "synthetic"
                   else f"{o['prompts']}")  # fmt: skip
        parts.append(
            f"<p class=meta><b>{_e(_label(result, i))}</b> ({_e(result['url'])}; "
            f"{_e(served_by(result))}), "
            f"{_e(result['started_at'])}; {o['output_tokens']} tokens out, prompts {_e(prompts)}; "
            f"{str(o['requests']) + ' requests' if o['duration'] is None else str(o['duration']) + ' s'}"
            f" a point after {o['warmup']} warm-up, {o['repeats']} run(s) each; aiperf {_e(result['tools']['aiperf'])}, trt-builder "
            f"{_e(result['tools']['trt-builder'])}{_e(recounted(result))}</p>"
        )
    parts.append(_curve(results))
    if len(results) == 2:
        parts.append(_comparison(results[0], results[1]))
    for i, result in enumerate(results):
        parts.append(f"<h2>{_e(_label(result, i))}</h2>{_table(result)}")
        parts.append(f"<h3>time to first token</h3>{_ttft_distribution(result)}")
    parts.append("</body></html>\n")
    return "".join(parts)
