"""In-flight batching over the checkpoint runtime: requests join and leave the running batch at
every decoding step, each with its own KV cache, so that a long request does not hold up short
ones (what TensorRT-LLM's batch manager does for an engine).

A request is prefilled alone when it joins, in a step of its own (its prompt through the model,
its first token from the last logits, sent at once). Every other step decodes one token for
every running request in one batched forward (CheckpointRuntime.decode): the GEMMs over all of
them on fixed blocks of rows, the attention of each over its own cache, which grows by one
token; so a request's tokens are the same whatever else runs with it. A request leaves the batch when it produces its end id, completes
a stop word, or reaches its `max_new_tokens`. Sampling follows TensorRT-LLM's request
parameters: greedy for top_k 0 or 1 with top_p 0, else temperature, then top-k, then top-p,
drawn from a generator seeded per request; bad words are masked before sampling.

This is the reference backend's engine (a PyTorch reference, not TensorRT-LLM): what it computes
is the checkpoint runtime's arithmetic, so a greedy answer equals CheckpointRuntime.greedy's,
bit for bit, at any load.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..core.errors import InputError
from .checkpoint import CheckpointRuntime, KVCache
from .requests import Event, Request, Sampling, StepFailed

__all__ = ["Event", "InflightBatcher", "Request", "Sampling", "StepFailed", "generate", "sample"]


@dataclass
class _Running:
    id: int
    request: Request
    cache: KVCache
    tokens: list[int]
    generator: torch.Generator


def _mask_bad_words(
    logits: torch.Tensor, tokens: list[int], bad: tuple[tuple[int, ...], ...]
) -> None:
    """Forbid each bad word's last token where the tokens so far end with the rest of it."""
    for word in bad:
        *head, last = word
        if not head or tokens[-len(head) :] == list(head):
            logits[last] = float("-inf")


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The next token from [vocab] logits (sampled on the CPU, so that a seed gives the same
    tokens on every host)."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    scores = logits.detach().double().cpu() / sampling.temperature
    if sampling.top_k > 1:  # exactly k kept, ties or not
        keep = torch.topk(scores, min(sampling.top_k, scores.numel())).indices
        kept = torch.full_like(scores, float("-inf"))
        kept[keep] = scores[keep]
        scores = kept
    if sampling.top_p > 0.0:
        ordered, order = torch.sort(scores, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always)
        drop = torch.cumsum(probs, dim=-1) - probs >= sampling.top_p
        scores = scores.clone()
        scores[order[drop]] = float("-inf")
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs.float(), 1, generator=generator))


class InflightBatcher:
    """Runs requests through a CheckpointRuntime, at most `max_batch_size` at a time; the rest
    wait in order. submit() between steps joins the batch at the next step."""

    def __init__(self, runtime: CheckpointRuntime, *, max_batch_size: int = 8) -> None:
        if max_batch_size < 1:
            raise InputError(f"max_batch_size must be at least 1, not {max_batch_size}")
        self.runtime = runtime
        self.max_batch_size = max_batch_size
        self.waiting: deque[tuple[int, Request]] = deque()
        self.running: list[_Running] = []
        self._ids = itertools.count()

    def submit(self, request: Request) -> int:
        """Queue a request; its id, as its events carry it."""
        rid = next(self._ids)
        self.waiting.append((rid, request))
        return rid

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def cancel(self, rid: int) -> None:
        """Drop a request, waiting or running (its client went away): its slot is free for the
        next step."""
        self.waiting = deque((i, r) for i, r in self.waiting if i != rid)
        self.running = [r for r in self.running if r.id != rid]

    def _choose(self, run: _Running, logits: torch.Tensor) -> Event:
        """The request's next token from its [vocab] logits, and whether it is done."""
        request = run.request
        logits = logits.clone()
        _mask_bad_words(logits, [*request.prompt, *run.tokens], request.bad_words)
        token = sample(logits, request.sampling, run.generator)
        run.tokens.append(token)
        if request.end_id is not None and token == request.end_id:
            return Event(run.id, token, True, "end_id")
        if any(run.tokens[-len(w) :] == list(w) for w in request.stop_words if w):
            return Event(run.id, token, True, "stop_word")
        if len(run.tokens) >= request.max_new_tokens:
            return Event(run.id, token, True, "length")
        return Event(run.id, token, False)

    @torch.inference_mode()
    def step(self) -> list[Event]:
        """One step: admit the first waiting request if the batch has room (its prompt through
        the model, its first token chosen at once, so that a joining request's first token
        waits for no other's prefill), else decode one token for every running request in one
        batched forward. The tokens chosen, in running order; StepFailed, with the requests
        dropped, if the forward raised."""
        if self.waiting and len(self.running) < self.max_batch_size:
            rid, request = self.waiting.popleft()
            generator = torch.Generator().manual_seed(request.sampling.seed)
            run = _Running(rid, request, KVCache(), [], generator)
            try:
                logits = self.runtime.forward(torch.tensor(request.prompt), run.cache, last=True)
                event = self._choose(run, logits[-1])
            except Exception as exc:  # this request's prefill: only it fails
                raise StepFailed([rid], exc) from exc
            if not event.finished:
                self.running.append(run)
            return [event]
        if not self.running:
            return []
        try:
            logits = self.runtime.decode([run.tokens[-1] for run in self.running],
                                         [run.cache for run in self.running])  # fmt: skip
            events = [self._choose(run, logits[row]) for row, run in enumerate(self.running)]
        except Exception as exc:  # every running request was in it; the waiting ones go on
            failed, self.running = [run.id for run in self.running], []
            raise StepFailed(failed, exc) from exc
        self.running = [r for r, e in zip(self.running, events, strict=True) if not e.finished]
        return events

    def run(self) -> Iterator[Event]:
        """Step until every submitted request has finished."""
        while not self.idle:
            yield from self.step()


def generate(
    runtime: CheckpointRuntime, requests: list[Request], *, max_batch_size: int = 8
) -> list[list[int]]:
    """Every request's tokens, run together with in-flight batching."""
    batcher = InflightBatcher(runtime, max_batch_size=max_batch_size)
    ids = [batcher.submit(r) for r in requests]
    out: dict[int, list[int]] = {i: [] for i in ids}
    for event in batcher.run():
        out[event.request].append(event.token)
    return [out[i] for i in ids]
