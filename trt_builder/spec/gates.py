"""A verify gate. Each mode's default gates are in its room (modes/<mode>/spec.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gate:
    """Pass criteria against the reference: teacher-forced top-1 agreement and mean
    KL(reference || candidate) on the prompt set, the held-out perplexity increase (percent),
    and optionally greedy agreement."""

    min_top1: float
    max_kl: float
    max_ppl_delta_pct: float | None = None
    min_greedy: float | None = None
