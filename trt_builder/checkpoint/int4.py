"""INT4 weights in groups (`quant_algo: W4A16_AWQ`), as TensorRT-LLM's checkpoint stores them
and its weight-only groupwise GEMM computes them; the converter writes them (modes/int4_awq/
convert.py), the checkpoint runtime executes them (runtimes/checkpoint.py).

- a group is `group` consecutive input channels of one output row; its scale is the group's
  absolute maximum / 7 (`weights_scaling_factor`, [out, in / group], float32 as modelopt's
  export writes it), and each weight is round(w / scale) clamped to the signed range -8..7
  (symmetric: no zero point);
- `weight` is int8 [out / 2, in]: two values per byte paired along the output dimension, row
  2j in the low nibble and row 2j + 1 in the high one (modelopt's pack_int4_in_uint8, viewed
  as int8, which is what trtllm-build's preprocess_weights_for_mixed_gemm takes); each tensor-
  parallel rank packs its own rows;
- the engine casts the scales to the model dtype and the GEMM dequantizes in it: q * scale,
  rounded to the model dtype, then a GEMM with float32 sums (CUTLASS's fpA_intB).
"""

from __future__ import annotations

import torch

from ..modes import Mode


def holds_int4(mode: Mode) -> bool:
    """Whether a checkpoint of `mode` stores its linears as packed INT4 groups."""
    return mode.weights is not None and mode.weights.name == "int4"


#: The largest magnitude a group's absmax maps to (modelopt: amax / 7; -8 is never reached).
INT4_MAX = 7


def group_scales(weight: torch.Tensor, group: int) -> torch.Tensor:
    """float32 [out, in / group]: each group's absmax / 7, never 0."""
    out, width = weight.shape
    amax = weight.float().abs().reshape(out, width // group, group).amax(-1)
    return (amax / INT4_MAX).clamp(min=torch.finfo(torch.float32).tiny)


def quantize_groups(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 [out, in] of values -8..7: round(w / scale) per group, in float32."""
    group = weight.shape[1] // scales.shape[1]
    expanded = scales.float().repeat_interleave(group, dim=1)
    return (weight.float() / expanded).round().clamp(-8, 7).to(torch.int8)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """int8 [out / 2, in] from int8 values -8..7 [out, in]: rows 2j (low nibble) and 2j + 1."""
    low, high = values[0::2].to(torch.uint8) & 0xF, values[1::2].to(torch.uint8) & 0xF
    return (low | (high << 4)).view(torch.int8)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """The int8 values -8..7 [out, in] of a packed [out / 2, in] weight (pack_rows' inverse)."""
    raw = packed.view(torch.uint8)
    low = (raw & 0xF).to(torch.int16)
    high = (raw >> 4).to(torch.int16)
    signed = torch.stack((low, high), dim=1).reshape(-1, raw.shape[1])
    return torch.where(signed > 7, signed - 16, signed).to(torch.int8)


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 [out, in]: each value times its group's scale, both in `dtype` and the product
    rounded to it, as the GEMM dequantizes (the scale was cast to the model dtype on load)."""
    group = values.shape[1] // scales.shape[1]
    expanded = scales.to(dtype).float().repeat_interleave(group, dim=1)
    return (values.float() * expanded).to(dtype).float()
