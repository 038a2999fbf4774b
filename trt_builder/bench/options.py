"""What a bench runs: the load points (closed-loop concurrency, open-loop Poisson request
rates), how long each runs, and the prompts. One frozen object, checked before any work."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..core.errors import SpecError

PROMPT_SOURCES = ("bundled", "synthetic")


@dataclass(frozen=True)
class BenchOptions:
    """A bench: every point of `concurrency` (closed loop: N requests always in flight) and of
    `rates` (open loop: Poisson arrivals at R requests/s), each for `requests` requests or
    `duration` seconds after `warmup` requests, `repeats` times.

    `prompts`: "bundled" (verify's prompt set, as chats), "synthetic" (`input_tokens` random
    tokens each), or a JSONL file of {"text": ..., "output_length": N} lines; `output_tokens`
    is each answer's length where a line does not say: its longest, unless `ignore_eos`, when
    every answer is that long (the request's end_id is -1, which no token is: TensorRT-LLM's
    own ignore_eos, tensorrt_llm/llmapi, sends the executor the same).
    """

    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    rates: tuple[float, ...] = ()
    requests: int = 32
    duration: float | None = None
    warmup: int = 2
    repeats: int = 1
    prompts: str = "bundled"
    input_tokens: int = 128
    output_tokens: int = 64
    ignore_eos: bool = False
    seed: int = 0
    model: str = ""  # "": tensorrt_llm_bls where the deployment has it, else the ensemble

    def __post_init__(self) -> None:
        if not self.concurrency and not self.rates:
            raise SpecError("nothing to run: give --concurrency and/or --rate")
        if any(c < 1 for c in self.concurrency):
            raise SpecError("--concurrency values must be 1 or more")
        if any(r <= 0 for r in self.rates):
            raise SpecError("--rate values must be above 0 (requests per second)")
        if self.duration is not None and self.duration <= 0:
            raise SpecError("--duration must be above 0 seconds (or leave it out for --requests)")
        if self.requests < 1:
            raise SpecError("--requests must be 1 or more")
        if self.warmup < 0 or self.repeats < 1:
            raise SpecError("--warmup must be 0 or more and --repeats 1 or more")
        if self.input_tokens < 1 or self.output_tokens < 1:
            raise SpecError("--input-tokens and --output-tokens must be 1 or more")
        if not isinstance(self.ignore_eos, bool):
            raise SpecError("ignore_eos must be true or false")
        if self.prompts not in PROMPT_SOURCES and not Path(self.prompts).suffix == ".jsonl":
            raise SpecError(f"--prompts {self.prompts!r}: use bundled, synthetic or a .jsonl file")

    def points(self) -> list[tuple[str, float]]:
        """(mode, load) of every point, in the order they run."""
        return [("concurrency", float(c)) for c in self.concurrency] + [
            ("rate", float(r)) for r in self.rates
        ]

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
