"""How the recipe searches score a candidate: per window of the search split, the mean KL
divergence from the float model, the perplexity increase and the top-1 agreement, each with
its standard error over the windows; and the successive halving both searches run."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..calibrate.stats import load_model
from ..source.hf import pick_device

WINDOW = 256


def mean_se(values: torch.Tensor) -> tuple[float, float]:
    n = values.numel()
    mean = float(values.mean())
    return mean, float(values.std(unbiased=True)) / math.sqrt(n) if n > 1 else 0.0


class Scorer:
    """The float model's next-token distributions on the scoring windows, and each candidate's
    per-window figures against them. KL(p || q) = sum p log p - sum p logits_q + lse(logits_q)
    (sum p = 1): one pass over the vocabulary per figure, no log-softmax materialised."""

    def __init__(self, model: Any, ids: torch.Tensor, batch: int, device: str) -> None:
        self.model, self.ids, self.batch, self.device = model, ids, batch, device
        self.p: list[torch.Tensor] = []  # the float model's probabilities, per batch
        self.neg_entropy: list[torch.Tensor] = []
        self.top: list[torch.Tensor] = []
        self.target_logp: list[torch.Tensor] = []
        for row, logits in self._logits():
            logp = torch.log_softmax(logits, -1)
            p = logp.exp()
            self.neg_entropy.append(torch.linalg.vecdot(p, logp))
            self.top.append(logits.argmax(-1))
            self.target_logp.append(self._target(logp, row))
            self.p.append(p)
            del logp

    def _target(self, values: torch.Tensor, row: int) -> torch.Tensor:
        target = self.ids[row : row + self.batch, 1:].to(values.device)[..., None]
        return values[:, :-1].gather(-1, target).squeeze(-1)

    def _logits(self, part: slice = slice(None)) -> Iterator[tuple[int, torch.Tensor]]:
        with torch.inference_mode():
            for row in list(range(0, self.ids.shape[0], self.batch))[part]:
                ids = self.ids[row : row + self.batch].to(self.device)
                yield row, self.model(ids, use_cache=False).logits.float()

    @property
    def batches(self) -> int:
        return -(-self.ids.shape[0] // self.batch)

    def windows(self, part: slice = slice(None)) -> dict[str, torch.Tensor]:
        """Per window of the batches in `part`: mean KL(float || candidate), mean NLL
        increase, top-1 agreement."""
        kl, dnll, top1 = [], [], []
        for (row, logits), i in zip(self._logits(part), range(self.batches)[part], strict=True):
            lse = torch.logsumexp(logits, -1)
            kl.append((self.neg_entropy[i] - torch.linalg.vecdot(self.p[i], logits) + lse)
                      .double().mean(-1))  # fmt: skip
            target = self._target(logits, row) - lse[:, :-1]
            dnll.append((self.target_logp[i] - target).double().mean(-1))
            top1.append((logits.argmax(-1) == self.top[i]).double().mean(-1))
        return {"kl": torch.cat(kl).cpu(), "dnll": torch.cat(dnll).cpu(),
                "top1": torch.cat(top1).cpu()}  # fmt: skip


def figures(windows: dict[str, torch.Tensor]) -> dict[str, float]:
    """A candidate's figures with their standard errors over the windows."""
    kl, kl_se = mean_se(windows["kl"])
    dnll, dnll_se = mean_se(windows["dnll"])
    top1, top1_se = mean_se(windows["top1"])
    growth = math.exp(dnll)
    return {
        "kl": kl,
        "kl_se": kl_se,
        "ppl_delta_pct": 100.0 * (growth - 1.0),
        "ppl_delta_pct_se": 100.0 * growth * dnll_se,
        "top1": top1,
        "top1_se": top1_se,
    }


def halving(
    apply: Callable[[Any], None],
    scorer: Scorer,
    trials: dict[str, Any],
    progress: Any,
) -> tuple[dict[str, dict[str, torch.Tensor]], list[str]]:
    """Successive halving (`apply` sets up a trial in the model): every candidate on the first half of the windows, the two with the
    least mean KL on the rest too. (Per-window figures by candidate, the finalists.)"""
    half = slice(0, max(1, scorer.batches // 2))
    rest = slice(half.stop, None)
    per_window: dict[str, dict[str, torch.Tensor]] = {}
    for name, trial in trials.items():
        progress(f"scoring {name}")
        apply(trial)
        per_window[name] = scorer.windows(half)
    finalists = sorted(per_window, key=lambda n: float(per_window[n]["kl"].mean()))[:2]
    for name in finalists if rest.start < scorer.batches else ():
        progress(f"scoring {name} on the other half")
        apply(trials[name])
        more = scorer.windows(rest)
        per_window[name] = {k: torch.cat((v, more[k])) for k, v in per_window[name].items()}
    return per_window, finalists


def searched_model(hf_dir: Any, device: str, offload: Any) -> tuple[str, Any, Any, str]:
    """What a search runs on: (the device picked, the tokenizer, the float model in eval mode,
    the device of its first parameters); the GPU's peak memory is counted from here."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    device = pick_device(device)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = load_model(hf_dir, device, offload).eval()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    return device, tokenizer, model, str(next(model.parameters()).device)


def choose_simplest(
    per_window: dict[str, dict[str, torch.Tensor]],
    finalists: list[str],
    simplest_first: tuple[str, ...],
) -> tuple[str, str]:
    """(the chosen candidate, the other finalist): the least mean KL, unless a simpler finalist
    (earlier in `simplest_first`) is within two standard errors of it in their paired
    per-window KL difference (then the simpler: a candidate that wins by noise would make the
    choice depend on the split's seed)."""
    ranked = sorted(finalists, key=lambda n: float(per_window[n]["kl"].mean()))
    best, other = ranked[0], ranked[-1]
    for name in simplest_first:
        if name == best:
            break
        if name in finalists:
            lead, se = mean_se(per_window[name]["kl"] - per_window[best]["kl"])
            if lead <= 2 * se:
                return name, best
    return best, other
