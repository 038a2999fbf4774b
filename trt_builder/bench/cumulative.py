"""Token figures for a deployment whose stream carries the whole text so far in every response:
TensorRT-LLM's llmapi model sends `RequestOutput.text`, which is cumulative (and 1.2.x sends
one response at the end, its streaming flag never reaching `generate_async`:
docs/llmapi.md). aiperf adds every response's text to the answer, so it counts the answer about
n/2 times over and its inter-token latency and output tokens/s are wrong; its time to first
token, end-to-end latency, request throughput and errors are not (they do not read the text).

What aiperf does not do, and is written here: from its raw records (`--export-level raw`: each
response's text and arrival), each answer's tokens are counted once, on the last response's
text, with the deployment's tokenizer and no special tokens (as aiperf counts); the first
response's own tokens are the first chunk. Per request, inter-token latency is aiperf's own
formula on those counts, (end-to-end - time to first token) / (tokens - first chunk's tokens),
and none where the first response held the whole answer (nothing was streamed after it);
output tokens/s is aiperf's, scaled by the true tokens over the tokens it counted (so its
duration is kept).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .loadgen import STATS

RAW = "profile_export_raw.jsonl"
RECORDS = "profile_export.jsonl"

Counter = Callable[[str], int]


def token_counter(tokenizer: Path) -> Counter:
    """Tokens in a text, as aiperf counts them (no special tokens), with the deployment's
    tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    return lambda text: len(tok.encode(text, add_special_tokens=False))


def _texts(record: dict[str, Any], field: str) -> list[str]:
    texts = []
    for response in record.get("responses") or []:
        for packet in response.get("packets") or []:
            if packet.get("name") != "data":
                continue
            try:
                value = json.loads(packet.get("value") or "").get(field)
            except (ValueError, AttributeError):
                continue
            if isinstance(value, list):  # Triton's JSON may give a one-element array
                value = value[0] if value else None
            if isinstance(value, str) and value:
                texts.append(value)
    return texts


def _metric(record: dict[str, Any], name: str) -> float | None:
    value = ((record.get("metrics") or {}).get(name) or {}).get("value")
    return None if value is None else float(value)


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return dict.fromkeys(STATS)
    a = np.asarray(values, dtype=np.float64)
    out: dict[str, float | None] = {"avg": float(a.mean())}
    for stat in STATS[1:]:
        out[stat] = float(np.percentile(a, float(stat[1:])))
    return out


def recount(figures: dict[str, Any], out: Path, count: Counter, field: str = "text_output") -> None:
    """Correct `figures` (loadgen.parse of the point in `out`) in place for a cumulative
    stream: itl_ms and output_token_throughput from the true token counts; the counts
    themselves as `output_tokens` (aiperf's as `aiperf_output_tokens`)."""
    raw = {}
    for line in (out / RAW).read_text().splitlines():
        row = json.loads(line)
        raw[(row.get("metadata") or {}).get("x_request_id")] = row
    itl: list[float] = []
    true_total = aiperf_total = 0
    for line in (out / RECORDS).read_text().splitlines():
        row = json.loads(line)
        meta = row.get("metadata") or {}
        if meta.get("benchmark_phase") == "warmup":
            continue
        counted = _metric(row, "output_sequence_length")
        texts = _texts(raw.get(meta.get("x_request_id")) or {}, field)
        if counted is None or not texts:  # an error: aiperf counted no tokens either
            continue
        tokens, first = count(texts[-1]), count(texts[0])
        true_total += tokens
        aiperf_total += int(counted)
        e2e, ttft = _metric(row, "request_latency"), _metric(row, "time_to_first_token")
        if e2e is not None and ttft is not None and tokens > first:
            itl.append((e2e - ttft) / (tokens - first))
    figures["itl_ms"] = _stats(itl)
    throughput = figures.get("output_token_throughput")
    if throughput is not None and aiperf_total:
        figures["output_token_throughput"] = throughput * true_total / aiperf_total
    figures["output_tokens"] = true_total
    figures["aiperf_output_tokens"] = aiperf_total
