"""The arithmetic of TensorRT-LLM's FP8 per-tensor GEMM (FP8Linear, `quant_algo: FP8`) and of
the FP8 KV cache, in one place: the converter stores the operands (modes/fp8/convert.py, rounded as
checkpoint/fp8.py says), the checkpoint runtime executes them.

- the input is quantized with its static scale a (`activation_scaling_factor`, a dequantization
  scale): e4m3(x / a), saturating at +-448 as TensorRT's FP8 quantize does;
- the weight is stored e4m3 with its scale w (`weights_scaling_factor`);
- the GEMM multiplies e4m3 by e4m3, accumulates in float32 and scales the sum by alpha = a * w.

On a CUDA GPU of SM 89 and up the GEMM runs on FP8 tensor cores (`torch._scaled_mm`); elsewhere,
and for shapes _scaled_mm does not take (K or N not a multiple of 16), it is simulated. On the
CPU the simulation is exact: each product of two e4m3 values has at most 8 significant bits and
is a multiple of 2^-18, and a sum of K of them is at most K * 448^2, so in float64 every partial
sum is exact for K up to 2^17, in any order; the float32 result is the exact sum rounded once,
the same on any number of threads and any row blocking. A float32 sum's order follows the BLAS
kernel's partition of the GEMM, which follows the thread count, and an FP8 model amplifies the
difference (an activation that crosses an e4m3 rounding boundary moves by 1/16): the default
model's verify figures moved by a point of top-1 between the two, and a served model's near-tie
token came out otherwise than the test process's. float64 costs the CPU about 1.7x a float32
GEMM; on a GPU without FP8 tensor cores (float64 at 1/64 rate on some) the simulation sums in
float32, and so does the recipe search's (`exact=False`: it ranks candidates, and runs the most
GEMMs). The tensor cores sum in float32 in an order of their own.
"""

from __future__ import annotations

import functools
import warnings

import torch

_NOTICED: set[tuple[int, int]] = set()


def fp8_kernel_runs(device: torch.device) -> bool:
    """Whether FP8 tensor-core GEMMs run on `device` (CUDA, compute capability 8.9 and up)."""
    return device.type == "cuda" and _capability(device.index) >= (8, 9)


def simulation_dtype(device: torch.device, exact: bool | None = None) -> torch.dtype:
    """The dtype the simulated GEMM sums in: float64 (exact) on the CPU unless told otherwise."""
    exact = device.type == "cpu" if exact is None else exact
    return torch.float64 if exact else torch.float32


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    """Asked once per device: fp8_matmul asks on every GEMM."""
    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


def fp8_matmul(
    xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
    *, kernel: bool | None = None, w_float: torch.Tensor | None = None, exact: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """e4m3 x [..., k] times e4m3 w [n, k], scaled by x_scale * w_scale: float32 [..., n].
    `kernel`: use the FP8 tensor cores (None: where they run); `exact`: simulate with exact
    sums (None: on the CPU); `w_float`: w in the simulation's dtype (simulation_dtype), which a
    caller that multiplies by w often keeps rather than cast it per call."""
    flat = xq.reshape(-1, xq.shape[-1])
    k, n = flat.shape[1], wq.shape[0]
    alpha = (x_scale.float() * w_scale.float()).reshape(())
    use = fp8_kernel_runs(xq.device) if kernel is None else kernel
    if use and (k % 16 or n % 16):
        if (k, n) not in _NOTICED:
            _NOTICED.add((k, n))
            warnings.warn(
                f"an FP8 GEMM of K={k}, N={n} runs simulated (torch._scaled_mm needs K and N "
                "multiples of 16)",
                stacklevel=2,
            )
        use = False
    if use:
        one = torch.ones((), dtype=torch.float32, device=xq.device)
        acc = torch._scaled_mm(
            flat.contiguous(), wq.t(), scale_a=one, scale_b=one, out_dtype=torch.float32
        )
    else:
        dtype = simulation_dtype(xq.device, exact)
        acc = (flat.to(dtype) @ (wq.to(dtype) if w_float is None else w_float).T).float()
    return (acc * alpha).reshape(*xq.shape[:-1], n)
