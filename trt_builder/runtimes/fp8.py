"""The arithmetic of TensorRT-LLM's FP8 per-tensor GEMM (FP8Linear, `quant_algo: FP8`) and of
the FP8 KV cache, in one place: the converter stores the operands (modes/fp8/convert.py, rounded as
checkpoint/fp8.py says), the checkpoint runtime executes them.

- the input is quantized with its static scale a (`activation_scaling_factor`, a dequantization
  scale): e4m3(x / a), saturating at +-448 as TensorRT's FP8 quantize does;
- the weight is stored e4m3 with its scale w (`weights_scaling_factor`);
- the GEMM multiplies e4m3 by e4m3, accumulates in float32 and scales the sum by alpha = a * w.

On a CUDA GPU of SM 89 and up the GEMM runs on FP8 tensor cores (`torch._scaled_mm`); elsewhere,
and for shapes _scaled_mm does not take (K or N not a multiple of 16), it is simulated: the
e4m3 values are exact in float32, and so is each product of two of them (4 + 4 significant
bits), so the simulation differs from the tensor cores only in the order of the float32 sums.
"""

from __future__ import annotations

import functools
import warnings

import torch

_NOTICED: set[tuple[int, int]] = set()


def fp8_kernel_runs(device: torch.device) -> bool:
    """Whether FP8 tensor-core GEMMs run on `device` (CUDA, compute capability 8.9 and up)."""
    return device.type == "cuda" and _capability(device.index) >= (8, 9)


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    """Asked once per device: fp8_matmul asks on every GEMM."""
    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


def fp8_matmul(
    xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
    *, kernel: bool | None = None, w_float: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """e4m3 x [..., k] times e4m3 w [n, k], scaled by x_scale * w_scale: float32 [..., n].
    `kernel`: use the FP8 tensor cores (None: where they run); `w_float`: w as float32, for
    the simulation (a caller that multiplies by w often keeps it, rather than cast it per call)."""
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
        acc = flat.float() @ (wq.float() if w_float is None else w_float).T
    return (acc * alpha).reshape(*xq.shape[:-1], n)
