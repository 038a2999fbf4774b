"""The simulated FP8 GEMM's sums on the CPU (runtimes/fp8.py): exact, so the same on any
thread count and any row blocking; an FP8 model amplifies a last-bit difference into other
tokens (a served model once answered otherwise than the test process that checked it)."""

from __future__ import annotations

import torch

from trt_builder.checkpoint.fp8 import E4M3
from trt_builder.runtimes.fp8 import fp8_matmul


def _operands(rows: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values across their whole range: heavy tails, and subnormals among them."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=gen) * torch.rand(rows, k, generator=gen).pow(6) * 400
    w = torch.randn(n, k, generator=gen) * 2.0 ** torch.randint(-12, 6, (n, k), generator=gen)
    return x.clamp(-448, 448).to(E4M3), w.clamp(-448, 448).to(E4M3)


def test_the_simulated_fp8_gemm_is_the_exact_sum_rounded_once() -> None:
    """Every e4m3 value is an integer times 2^-9, so each product is an integer times 2^-18:
    the exact sum in integers (int64), rounded once to float32, is what the GEMM gives."""
    xq, wq = _operands(16, 1536, 96)
    one = torch.ones(())
    got = fp8_matmul(xq, wq, one, one, kernel=False)
    xi = (xq.float() * 2**9).to(torch.int64)
    wi = (wq.float() * 2**9).to(torch.int64)
    assert torch.equal(xi.double() / 2**9, xq.double())  # the integers are exact
    exact = (xi[:, None, :] * wi[None, :, :]).sum(-1)  # int64: no rounding at all
    want = (exact.double() * 2.0**-18).float()  # |sum| < 2^53 * 2^-18: one rounding, to float32
    assert torch.equal(got, want)
    float32_sums = xq.float() @ wq.float().T  # what it summed before: ulps apart, here and there
    assert not torch.equal(float32_sums, want)


def test_the_simulated_fp8_gemm_is_the_same_on_any_thread_count_and_row_blocking() -> None:
    xq, wq = _operands(64, 576, 960)
    one = torch.ones(())
    threads = torch.get_num_threads()
    whole, first = [], []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            whole.append(fp8_matmul(xq, wq, one, one, kernel=False))
            whole.append(torch.cat([fp8_matmul(xq[i : i + 8], wq, one, one, kernel=False)
                                    for i in range(0, 64, 8)]))  # fmt: skip
            first.append(fp8_matmul(xq[:1], wq, one, one, kernel=False))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(answer, whole[0]) for answer in whole)
    assert all(torch.equal(answer, whole[0][:1]) for answer in first)
