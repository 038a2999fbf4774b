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


def kl_reported(ref_logits: torch.Tensor, cand_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(reference || candidate) where the candidate gives log-probabilities of some tokens
    only (-inf for the rest: a runtime that reports its top tokens, runtimes/vllm.py): the
    tokens it reports, and all the others pooled into one, for both distributions. Pooling can
    only lower a KL divergence: this is a lower bound of the full one, exact where the
    candidate reports every token."""
    lp = torch.log_softmax(ref_logits.double(), -1)
    lq = cand_logprobs.double()
    known = torch.isfinite(lq)
    p = lp.exp()
    reported = torch.where(known, p * (lp - lq.where(known, 0.0)), 0.0).sum(-1)
    p_rest = torch.where(known, 0.0, p).sum(-1)
    q_rest = (1.0 - torch.where(known, lq.exp(), 0.0).sum(-1)).clamp(min=1e-30)
    rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp(min=1e-300).log() - q_rest.log()), 0.0)
    return reported + rest


def nll_reported(logprobs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """nll() of a runtime's log-probabilities, as given (not renormalised over what it reports:
    each next token's is among them)."""
    return -logprobs[:-1].double().gather(-1, ids[1:, None])[:, 0]
