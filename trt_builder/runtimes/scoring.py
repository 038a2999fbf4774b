"""Scoring logits against a reference: per-token negative log-likelihood and KL divergence."""

from __future__ import annotations

import torch


def kl(ref_logits: torch.Tensor, cand_logits: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(ref_logits.double(), -1)
    lq = torch.log_softmax(cand_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of each next token ([tokens - 1])."""
    return torch.nn.functional.cross_entropy(logits[:-1].double(), ids[1:], reduction="none")
