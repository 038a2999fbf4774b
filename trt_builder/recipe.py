"""The INT8 recipe search: pick SmoothQuant's alpha by accuracy, not by habit.

Each candidate alpha is converted (from the same calibration) and run by the reference runtime
on the search split of the bundled corpus (`data/corpus/search.jsonl`: never used for
calibration, nor for verify's held-out figures); the transformers model's logits on the same
windows are computed once. The candidate with the smallest perplexity increase wins (ties: the
higher top-1 agreement). Every candidate's figures are kept, for the manifest and the report.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from .quant import SmoothQuant

#: The alphas tried by `alpha = "auto"`.
ALPHAS = (0.4, 0.5, 0.6, 0.7, 0.8)


def _score(
    logits: list[torch.Tensor], ids: torch.Tensor, ref: list[torch.Tensor]
) -> dict[str, float]:
    from .verify import _nll

    nll_c = sum(float(_nll(c, i).sum()) for c, i in zip(logits, ids, strict=True))
    nll_r = sum(float(_nll(r, i).sum()) for r, i in zip(ref, ids, strict=True))
    hits = sum(
        float((c.argmax(-1) == r.argmax(-1)).sum()) for c, r in zip(logits, ref, strict=True)
    )
    predicted = ids[:, 1:].numel()
    return {
        "ppl_delta_pct": 100.0 * (math.exp((nll_c - nll_r) / predicted) - 1.0),
        "top1": hits / ids.numel(),
    }


def search_alpha(
    hf_dir: Path,
    work: Path,
    mode: SmoothQuant,
    calibration: Path,
    *,
    alphas: tuple[float, ...] = ALPHAS,
    tokens: int = 2048,
) -> tuple[float, dict[str, Any]]:
    """(the chosen alpha, the search record: every candidate's figures)."""
    from transformers import AutoTokenizer

    from .runtime.reference import ReferenceModel
    from .smoothquant import convert_smoothquant
    from .verify import corpus_windows, load_reference

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    ids = torch.tensor(corpus_windows(tokenizer, tokens, split="search"))
    model = load_reference(hf_dir).eval()
    with torch.inference_mode():
        ref = [model(ids[i : i + 8]).logits.float() for i in range(0, ids.shape[0], 8)]
    reference = [row for batch in ref for row in batch]
    del model
    candidates = []
    for alpha in alphas:
        trial = work / f".search-{alpha}"
        trial.mkdir(parents=True)
        try:
            convert_smoothquant(hf_dir, trial, replace(mode, alpha=alpha), calibration)
            runtime = ReferenceModel.load(trial)
            logits = [
                row for i in range(0, ids.shape[0], 8) for row in runtime.forward(ids[i : i + 8])
            ]
        finally:
            shutil.rmtree(trial, ignore_errors=True)
        candidates.append({"alpha": alpha, **_score(logits, ids, reference)})
    best = min(candidates, key=lambda c: (c["ppl_delta_pct"], -c["top1"]))
    record = {
        "method": "global alpha, scored on the search split (perplexity increase, then top-1)",
        "tokens": int(ids.numel()),
        "candidates": candidates,
        "chosen_alpha": best["alpha"],
        "seconds": round(time.perf_counter() - start, 2),
    }
    return float(best["alpha"]), record
