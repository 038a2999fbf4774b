"""The arithmetic of TensorRT-LLM's SmoothQuant plugin GEMM, in one place: the converter stores
its operands (trt_builder/modes/smoothquant/convert.py), the checkpoint runtime executes them
(runtimes/checkpoint.py), and the recipe search simulates candidates with it in memory
(trt_builder/recipe/). docs/quantization.md states the formats.

- a smoother per input channel, s_c = max(ax_c^alpha / max_j|W_jc|^(1-alpha), 1e-5), over every
  GEMM that reads that input;
- int8 weights per output row, round_half_even(W' * 127 / aw_j), aw_j the row's max |W'|;
- int8 activations per token (a dynamic scale m / 127, m the row's max |x|) or with one static
  scale; the GEMM accumulates int8 x int8 in int32, exactly: `torch._int_mm` on CUDA; on the
  CPU float32 GEMMs over blocks of 1024 input channels, summed in float64 (every partial sum is
  an integer below 2^24, so exact; oneDNN's CPU `_int_mm` measured 15x slower than this on a
  CPU without VNNI), and float64 where `_int_mm` does not take a shape.
"""

from __future__ import annotations

import functools
import time

import torch

#: The INT8 GEMMs of a decoder layer (TensorRT-LLM names); dense and proj keep their smoother
#: (the others fold it into the norm in front of them).
GEMMS = ("attention.qkv.weight", "attention.dense.weight", "mlp.fc.weight", "mlp.gate.weight",
         "mlp.proj.weight")  # fmt: skip
KEEPS_SMOOTHER = ("attention.dense.weight", "mlp.proj.weight")
#: GEMMs that read one input, and so share one smoother, by the first of them.
GROUPS = {
    "attention.qkv.weight": ["attention.qkv.weight"],
    "attention.dense.weight": ["attention.dense.weight"],
    "mlp.fc.weight": ["mlp.fc.weight", "mlp.gate.weight"],
    "mlp.proj.weight": ["mlp.proj.weight"],
}


def group_name(lead: str) -> str:
    """qkv, dense, fc, proj: how a group is named in per-layer alphas."""
    return lead.split(".")[1]


def smoother(
    ax: torch.Tensor, weights: list[torch.Tensor] | torch.Tensor, alpha: float
) -> torch.Tensor:
    """s per input channel for GEMMs that share an input: ax^alpha / max|W|^(1-alpha);
    `weights`: the GEMMs' weights [out, in], or their max |W| per input channel already."""
    if isinstance(weights, torch.Tensor):
        wmax = weights.float()
    else:
        wmax = torch.stack([w.abs().amax(dim=0).float() for w in weights]).amax(dim=0)
    s = ax.float().clamp(min=1e-5).pow(alpha) / wmax.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, aw per output row): round half to even of w * 127 / aw."""
    aw = w.abs().amax(dim=1).float().clamp(min=1e-8)
    q = torch.round(w.float() * (127.0 / aw)[:, None]).clamp(-127, 127).to(torch.int8)
    return q, aw


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token activations: (int8 x, the scale of each row, m / 127)."""
    m = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-6)
    return torch.round(x.float() * (127.0 / m)).clamp(-128, 127).to(torch.int8), m / 127.0


def quantize_static(x: torch.Tensor, to_int: torch.Tensor) -> torch.Tensor:
    """Per-tensor activations: int8 of x * to_int (the stored `scale_to_int`)."""
    return torch.round(x.float() * to_int).clamp(-128, 127).to(torch.int8)


#: Input channels per float32 block on the CPU: |sum| <= 128 * 127 * 1024 < 2^24, so every
#: partial sum is an exactly representable integer whatever order BLAS adds in.
EXACT_F32_BLOCK = 1024


@functools.cache
def cpu_int_mm_faster() -> bool:
    """Whether this CPU's `torch._int_mm` beats float32 GEMMs of the same int8 values, timed on
    one product of the default model's size (about 50 ms, once per process). Both are exact,
    so the answer changes how long a GEMM takes, never its result."""
    x = torch.randint(-127, 128, (512, 1024), dtype=torch.int8)
    w = torch.randint(-127, 128, (1024, 1024), dtype=torch.int8)

    def seconds(product: object) -> float:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            product()  # type: ignore[operator]
            best = min(best, time.perf_counter() - start)
        return best

    try:
        integer = seconds(lambda: torch._int_mm(x, w.T))
    except RuntimeError:  # a build without the CPU kernel
        return False
    return integer < seconds(lambda: x.float() @ w.float().T)


def int8_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., k] int8 times w [n, k] int8, accumulated exactly; float32 [..., n]."""
    flat = x.reshape(-1, x.shape[-1])
    m, k = flat.shape
    if x.device.type == "cpu":
        if m > 0 and cpu_int_mm_faster():
            return torch._int_mm(flat, w.T).float().reshape(*x.shape[:-1], w.shape[0])
        xf, wf = flat.float(), w.float()
        if k <= EXACT_F32_BLOCK:
            return (xf @ wf.T).reshape(*x.shape[:-1], w.shape[0])
        acc = torch.zeros(m, w.shape[0], dtype=torch.float64)
        for start in range(0, k, EXACT_F32_BLOCK):
            end = start + EXACT_F32_BLOCK
            acc += xf[:, start:end] @ wf[:, start:end].T
        return acc.float().reshape(*x.shape[:-1], w.shape[0])
    if k % 8 == 0 and w.shape[0] % 8 == 0 and m > 16:
        try:
            return torch._int_mm(flat, w.T).float().reshape(*x.shape[:-1], w.shape[0])
        except RuntimeError:  # a device or shape the kernel does not take: the exact fallback
            pass
    acc = (flat.double() @ w.double().T).float()
    return acc.reshape(*x.shape[:-1], w.shape[0])
