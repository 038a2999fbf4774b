"""The headline figures of a bench point, and their summary over repeats."""

from __future__ import annotations

import statistics
from typing import Any

#: The figures of a point that summaries, comparisons and the nightly's gates use, and which
#: way is better (+1: higher).
HEADLINE: dict[str, int] = {
    "output_token_throughput": +1, "request_throughput": +1,
    "ttft_ms.p50": -1, "ttft_ms.p99": -1, "itl_ms.p50": -1, "itl_ms.p99": -1,
    "e2e_ms.p50": -1, "e2e_ms.p99": -1, "errors": -1,
}  # fmt: skip


def value(figures: dict[str, Any], metric: str) -> float | None:
    """A headline metric ("ttft_ms.p50") of one run's figures."""
    head, _, stat = metric.partition(".")
    found = figures.get(head)
    if stat:
        found = (found or {}).get(stat)
    return None if found is None else float(found)


def summarize(repeats: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each headline metric over a point's repeats: mean, standard deviation, min, max."""
    out: dict[str, dict[str, float | None]] = {}
    for metric in HEADLINE:
        xs = [x for x in (value(r, metric) for r in repeats) if x is not None]
        out[metric] = {
            "mean": statistics.fmean(xs) if xs else None,
            "std": statistics.stdev(xs) if len(xs) > 1 else None,
            "min": min(xs) if xs else None,
            "max": max(xs) if xs else None,
            "n": float(len(xs)),
        }
    return out
