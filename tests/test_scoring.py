"""KL and NLL where a runtime reports some tokens' log-probabilities only (vLLM's top tokens):
the pooled KL is the full one where every token is reported, and never above it otherwise."""

from __future__ import annotations

import torch

from trt_builder.runtimes.scoring import kl, kl_reported, nll, nll_reported


def test_pooling_the_unreported_tokens_gives_the_full_kl_or_a_lower_bound() -> None:
    generator = torch.Generator().manual_seed(0)
    ref = torch.randn(6, 50, generator=generator, dtype=torch.float64) * 2
    cand = ref + torch.randn(6, 50, generator=generator, dtype=torch.float64) * 0.7
    logprobs = torch.log_softmax(cand, -1)
    full = kl(ref, cand)
    assert torch.allclose(kl_reported(ref, logprobs), full, atol=1e-12)
    for k in (1, 5, 20, 49):
        top = logprobs.topk(k, -1).indices
        partial = torch.full_like(logprobs, float("-inf")).scatter(
            -1, top, logprobs.gather(-1, top)
        )
        pooled = kl_reported(ref, partial)
        assert bool((pooled <= full + 1e-12).all()) and bool((pooled >= -1e-12).all()), k
    # the text's tokens are always reported: their NLL is the candidate's own, not renormalised
    ids = torch.tensor([3, 7, 1, 0, 42, 9])
    kept = torch.full_like(logprobs, float("-inf"))
    rows = torch.arange(6)
    kept[rows[:-1], ids[1:]] = logprobs[rows[:-1], ids[1:]]
    assert torch.allclose(nll_reported(kept, ids), nll(cand, ids), atol=1e-12)
