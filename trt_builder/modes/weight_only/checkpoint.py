"""INT8 weight-only (W8A16) in the checkpoint formats: which GEMMs it quantizes, and the
per-output-channel rounding of the llmapi target's Hugging Face checkpoint.

The engine target writes float weights with `quant_algo: W8A16`, and trtllm-build quantizes
them (runtimes/checkpoint.py weight_only_int8 says how). The llmapi target writes the INT8
values itself, as modelopt 0.47's export_hf_checkpoint does after INT8_WEIGHT_ONLY_CFG:
`weight` int8 [out, in] and `weight_scale` [out], amax / 127 per output row, which TensorRT-
LLM's PyTorch backend (WeightOnlyQuantLinearMethod) casts to the model dtype at load. The
scale written is already in the model dtype (stored as float32): the scale the GEMM uses is the
one the weights were rounded against (docs/llmapi.md).
"""

from __future__ import annotations

import torch

#: Linears trtllm-build quantizes for W8A16 (TensorRT-LLM's weight_only_quantize_dict).
WEIGHT_ONLY_LINEARS = ("qkv.weight", "dense.weight", "fc.weight", "proj.weight", "gate.weight")


def quantize_rows(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [out, in], float32 [out]) of a float weight [out, in]: per row, scale = amax / 127
    rounded to `dtype`, the weight divided by it in float32, rounded to nearest (ties to even)
    and saturated at +-127."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).to(dtype).float()
    scale = scale.clamp(min=torch.finfo(dtype).tiny)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale
