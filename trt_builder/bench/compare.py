"""Two bench results side by side: for every load point both ran, each headline metric's
values, the ratio, and whether the difference is beyond the noise of the repeats."""

from __future__ import annotations

import math
from typing import Any

from .figures import HEADLINE

Z = 2.0  # a difference beyond 2 standard errors of the difference counts as real


def _key(point: dict[str, Any]) -> tuple[str, float]:
    return str(point["mode"]), float(point["load"])


def verdict(a: dict[str, float | None], b: dict[str, float | None], better: int) -> str:
    """ "better", "worse" or "within noise" (B against A) from two points' summaries of one
    metric; "unknown" without repeats on both sides (no spread to judge by)."""
    if a["mean"] is None or b["mean"] is None:
        return "unknown"
    diff = float(b["mean"]) - float(a["mean"])
    if diff == 0:
        return "same"
    if a["std"] is None or b["std"] is None:
        return "unknown (1 run each: --repeats 3 to judge)"
    se = math.sqrt(
        float(a["std"]) ** 2 / float(a["n"] or 1) + float(b["std"]) ** 2 / float(b["n"] or 1)
    )
    if abs(diff) <= Z * se:
        return "within noise"
    return "better" if diff * better > 0 else "worse"


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows (mode, load, metric, A mean, B mean, B/A, verdict) for the points of both."""
    theirs = {_key(p): p for p in b["points"]}
    rows = []
    for point in a["points"]:
        other = theirs.get(_key(point))
        if other is None:
            continue
        for metric, better in HEADLINE.items():
            sa, sb = point["summary"][metric], other["summary"][metric]
            ratio = (
                float(sb["mean"]) / float(sa["mean"])
                if sa["mean"] not in (None, 0) and sb["mean"] is not None
                else None
            )
            rows.append({"mode": point["mode"], "load": point["load"], "metric": metric,
                         "a": sa["mean"], "b": sb["mean"], "ratio": ratio,
                         "verdict": verdict(sa, sb, better)})  # fmt: skip
    return rows
