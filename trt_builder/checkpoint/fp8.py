"""FP8 in TensorRT-LLM's checkpoint formats: e4m3 values of x / scale with a float32
dequantization scale, per tensor (runtimes/fp8.py computes with them; modes/fp8/convert.py and the
recipe write them; targets/llmapi/checkpoint/unified.py reads and writes them in Hugging Face names)."""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
#: The GEMMs the FP8 checkpoint stores in e4m3 (TensorRT-LLM names, within a decoder layer).
FP8_LINEARS = ("attention.qkv.weight", "attention.dense.weight", "mlp.fc.weight",
               "mlp.gate.weight", "mlp.proj.weight")  # fmt: skip


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 of x / scale, divided in float32 and saturated at +-448 (the cast itself need not
    saturate on every device): an activation as the engine quantizes it, and a weight as
    modelopt's exporter writes it."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(E4M3)


def weight_scale(weights: list[torch.Tensor]) -> torch.Tensor:
    """weights_scaling_factor (float32 (1,)) of one GEMM's weight, or of weights that share one.
    448 is a tensor, not a Python number: CUDA divides by a Python number as a multiplication by
    its reciprocal, an ulp off at times (measured on the H200), and the scale must be the same
    wherever the conversion runs."""
    amax = torch.stack([w.abs().amax().float() for w in weights]).amax()
    scale = amax / torch.full_like(amax, FP8_MAX)
    return scale.clamp(min=torch.finfo(torch.float32).tiny).reshape(1)
