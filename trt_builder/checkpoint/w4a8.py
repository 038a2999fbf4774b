"""W4A8 AWQ (`quant_algo: W4A8_AWQ`): W4A16 AWQ's INT4 groups (checkpoint/int4.py, group 128)
with FP8 inputs, as TensorRT-LLM stores and computes them (docs/upstream/w4a8-arithmetic.md,
read from its loader, plugin, CUTLASS kernels and PyTorch backend). Each linear adds two float32
scalars to INT4 AWQ's tensors:

- `weights_scaling_factor_2` s2: the FP8 stage of the weight, amax(q * s_g) / 448 over the
  GEMM (modelopt's second weight quantizer; fused GEMMs share the largest);
- `activation_scaling_factor` a: the input's FP8 scale, amax(x * p) / 448 from calibration
  (p: the pre-quantization scale the input is multiplied by first).

The GEMM (CUTLASS, SM 89 and 90, engine and PyTorch backend alike): the weight's group scale in
float16, divided by s2 and rounded to float16 (s'); each weight e4m3(float16(q * s')); the input
e4m3 of x * p / a; e4m3 products summed in float32; the sum times alpha = a * s2, plus the bias,
rounded to the model dtype. Where p / a is applied differs (w4a8_input):
- the engine (trtllm-build's loader divides p by a into the model dtype): e4m3(D(x * D(p / a)));
- TensorRT-LLM's PyTorch backend (p multiplied in the model dtype, then a float32 division, or
  p folded into the norm before): e4m3(D(x * p) / a).
The engine's CUDA-core GEMV tactic (which its profiler may choose for fewer than 16 rows) takes
no FP8 at all; it is not simulated here (docs/quantization.md).
"""

from __future__ import annotations

import torch

from .fp8 import E4M3, FP8_MAX, weight_scale


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """e4m3 of float32 `x`, round to nearest even, saturating at +-448 (cvt.rn.satfinite)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(E4M3)


def weight_scale_2(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 (1,): amax(q * s_g) / 448 of INT4 `values` [out, in] at group `scales`."""
    group = values.shape[1] // scales.shape[1]
    return weight_scale([values.float() * scales.float().repeat_interleave(group, 1)])


def activation_scale(absmax: torch.Tensor, pqs: torch.Tensor | None) -> torch.Tensor:
    """float32 (1,): max over channels of the calibrated input absmax times p, / 448."""
    return weight_scale([absmax.float() if pqs is None else absmax.float() * pqs.float()])


def input_scales(
    absmax: torch.Tensor, pqs: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, a) of one GEMM: a = activation_scale(absmax, p), and p set to a on the channels no
    input reaches and no weight reads (a padded twin's added channels): trtllm-build's loader
    divides p by a in the model dtype, where such a channel's p (AWQ's scale of a channel it
    never saw, 170 in modelopt's export of SmolLM2's twin) overflowed float16 to inf, and the
    GEMM's 0 x inf made every output NaN. Neither p nor a changes anything else: the channel's
    input is 0, its weight column 0 at any p."""
    a = activation_scale(absmax, pqs)
    unused = (absmax.to(weight.device) == 0) & (weight == 0).all(0)
    return torch.where(unused, a.to(weight.device, pqs.dtype), pqs), a


def fp8_weight(
    values: torch.Tensor, scales: torch.Tensor, s2: torch.Tensor, dtype: torch.dtype,
    *, engine: bool = True,
) -> torch.Tensor:  # fmt: skip
    """The e4m3 weight [out, in] the GEMM multiplies: e4m3(float16(q * s')), s' the group scale
    over s2 in float16 (the engine's loader divides in the model dtype first: for bfloat16 its s'
    has bfloat16's precision)."""
    s2 = s2.float().reshape(())
    if engine:
        scaled = (scales.to(dtype).float() / s2).to(dtype).to(torch.float16)
    else:
        scaled = (scales.to(torch.float16).float() / s2).to(torch.float16)
    group = values.shape[1] // scales.shape[1]
    product = (values.float() * scaled.float().repeat_interleave(group, 1)).to(torch.float16)
    return _e4m3(product.float())


def w4a8_input(
    x: torch.Tensor, pqs: torch.Tensor | None, a: torch.Tensor, dtype: torch.dtype,
    *, engine: bool = True,
) -> torch.Tensor:  # fmt: skip
    """The e4m3 input [..., in] of float32 `x` (in the model dtype's values), as the engine or
    the PyTorch backend quantizes it (module docstring)."""
    a = a.float().reshape(())
    if engine:
        p = torch.ones(x.shape[-1], device=x.device) if pqs is None else pqs.float()
        return _e4m3((x * (p / a).to(dtype).float()).to(dtype).float())
    scaled = x if pqs is None else (x * pqs.float()).to(dtype).float()
    return _e4m3(scaled / a)
