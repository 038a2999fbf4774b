"""NVFP4 (`quant_algo: NVFP4`): e2m1 values in blocks of 16 along the input, each block with an
e4m3 scale, and one float32 global scale per tensor, as modelopt 0.47 writes weights
(`NVFP4QTensor`) and TensorRT-LLM's FP4 GEMM reads them; the converter writes them
(modes/nvfp4/convert.py) and the checkpoint runtime executes them (runtimes/checkpoint.py).

- the global scale s2 = amax / (6 x 448) (float32; `weights_scaling_factor_2` of a weight,
  `activation_scaling_factor` of a GEMM's input, its calibrated amax);
- each block's scale: the block's absmax / (6 x s2), 1 where the block is all zeros, clamped to
  [2^-9, 448] and rounded to e4m3 (`weights_scaling_factor`, float8_e4m3fn [out, in / 16]: not
  swizzled; TensorRT-LLM interleaves it itself at build and load);
- each value: x / (block scale x s2), rounded to the nearest e2m1 value (0, 0.5, 1, 1.5, 2, 3,
  4, 6; ties to the even one; beyond 6 saturated), a 4-bit code sign << 3 | magnitude index;
- `weight`: uint8 [out, in / 2], two codes a byte along the input, column 2k in the low nibble.
"""

from __future__ import annotations

import torch

from ..modes import Mode


def holds_nvfp4(mode: Mode) -> bool:
    """Whether a checkpoint of `mode` stores its linears as packed e2m1 blocks."""
    return mode.weights is not None and mode.weights.name == "nvfp4"


#: Values per block scale (TensorRT-LLM's FP4Linear: scaling_vector_size).
BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: The e2m1 magnitudes by code (the sign is bit 3).
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
#: Midpoints between neighbours; at the odd ones (0.75, 1.75, 3.5) a tie goes up, to the even
#: code (modelopt's `_cast_fp4`: round to nearest even).
_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_ODD_BOUNDS = torch.tensor([0.75, 1.75, 3.5])


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    """float32 s2 of a tensor whose absolute maximum is `amax`: amax / (6 x 448), never 0 (an
    all-zero weight then has block scales 1 and codes 0, where modelopt 0.47 writes NaN
    scales and codes of 6)."""
    return (amax.float() / (E2M1_MAX * E4M3_MAX)).clamp(min=torch.finfo(torch.float32).tiny)


def block_scales(weight: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [out, in / 16]: each block's absmax / (6 s2), 1 for an all-zero block,
    clamped to [2^-9, 448]."""
    out, width = weight.shape
    amax = weight.float().abs().reshape(out, width // BLOCK, BLOCK).amax(-1)
    scale = amax / (E2M1_MAX * scale_2.float())
    scale[scale == 0] = 1.0
    return scale.clamp(min=2**-9, max=E4M3_MAX).to(torch.float8_e4m3fn)


def to_codes(scaled: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes (0..15) of values already divided by their scales."""
    magnitude = scaled.float().abs()
    code = torch.searchsorted(_BOUNDS.to(scaled.device), magnitude, out_int32=True)
    tie_up = (magnitude[..., None] == _ODD_BOUNDS.to(scaled.device)).any(-1)
    sign = (scaled < 0).to(torch.int32) << 3
    return (sign + code + tie_up.to(torch.int32)).to(torch.uint8)


def from_codes(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of e2m1 codes."""
    magnitude = E2M1.to(codes.device)[(codes & 7).long()]
    return torch.where((codes & 8).bool(), -magnitude, magnitude)


def round_e2m1(scaled: torch.Tensor) -> torch.Tensor:
    """float32 e2m1 values of values already divided by their scales: from_codes(to_codes(x)),
    to the bit for every input but NaN (tested), without the codes. On each stretch of the grid
    its step is a power of two and its codes' parity is the values' (0, 0.5, ... 2 by 0.5; 2,
    3, 4; 4, 6), so rounding half to even at that step is the codes' tie rule; beyond 6 it
    saturates. The recipe search and the runtime round every activation this way (the default
    model's NVFP4 search: fake_quantize 29.0 s through the codes, 12.9 s this way)."""
    x = scaled.float()
    m = x.abs()
    v = torch.where(
        m < 2,
        torch.round(m * 2) * 0.5,
        torch.where(m < 4, torch.round(m), (torch.round(m * 0.5) * 2).clamp(max=E2M1_MAX)),
    )
    return torch.where(scaled < 0, -v, v)  # the sign of the input, as to_codes takes it


def quantize_blocks(
    weight: torch.Tensor, scales: torch.Tensor, scale_2: torch.Tensor
) -> torch.Tensor:
    """uint8 codes [out, in] of `weight` at its block scales (e4m3) and global scale."""
    out, width = weight.shape
    step = scales.float() * scale_2.float()
    scaled = weight.float().reshape(out, width // BLOCK, BLOCK) / step[..., None]
    return to_codes(scaled.reshape(out, width))


def pack_columns(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in / 2] of codes [out, in]: column 2k in the low nibble."""
    return (codes[:, 1::2] << 4) | codes[:, 0::2]


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """The codes [out, in] of a packed [out, in / 2] weight (pack_columns' inverse)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """float32 [out, in]: each value times its block's scale times the global scale."""
    step = (scales.float() * scale_2.float()).repeat_interleave(BLOCK, dim=-1)
    return from_codes(codes) * step


#: 1/6 rounded to float32 (0x3E2AAAAB), as the kernel multiplies by it.
_INV_E2M1_MAX = torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32)


def quantize_activations(
    x: torch.Tensor, scale_2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e2m1 codes [rows, in], float32 block scales [rows, in / 16, 1]) of `x` [rows, in] as
    TensorRT-LLM's FP4 GEMM quantizes its input at run time (`cvt_warp_fp16_to_fp4`, its
    default recipe) at the calibrated global scale a = `scale_2`, with S = 1 / a (the PyTorch
    backend's `1.0 / input_scale`) and m each block's absmax:
    - block scale SF = e4m3(S x (m x 1/6)), saturated at 448: a block whose SF rounds to 0
      contributes 0 (the kernel does not clamp it up, as the weights' export does);
    - each value e2m1(x x os), os = 1 / (SF x (1 / S)), to nearest even, saturated at 6.
    The kernel's reciprocals are `rcp.approx.ftz` (within an ulp); these are IEEE ones, as
    vLLM's reference (`ref_nvfp4_quant`) computes them: a value within an ulp of a rounding
    midpoint may take the other code there."""
    rows, width = x.shape
    flat, output_scale, sf = _activation_blocks(x, scale_2)
    return to_codes(flat * output_scale).reshape(rows, width), sf


def _activation_blocks(
    x: torch.Tensor, scale_2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(`x` [rows, in] in float32 blocks [rows, in / 16, 16], each block's os, its SF):
    quantize_activations' arithmetic up to the rounding."""
    rows, width = x.shape
    flat = x.float().reshape(rows, width // BLOCK, BLOCK)
    big_s = 1.0 / scale_2.float().reshape(())
    m = flat.abs().amax(-1, keepdim=True)
    sf = (big_s * (m * _INV_E2M1_MAX.to(x.device))).clamp(max=E4M3_MAX)
    sf = sf.to(torch.float8_e4m3fn).float()
    output_scale = torch.where(sf != 0, 1.0 / (sf * (1.0 / big_s)), torch.zeros_like(sf))
    return flat, output_scale, sf


def fake_quantize(x: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """float32 `x` [..., in] as the FP4 GEMM takes it (quantize_activations, along the last
    dimension), dequantized: e2m1 x SF x a (the GEMM's alpha a x s2 times its exact block
    products)."""
    shape = x.shape
    flat, output_scale, sf = _activation_blocks(x.reshape(-1, shape[-1]), scale_2)
    values = round_e2m1(flat * output_scale)
    return (values * sf * scale_2.float().reshape(())).reshape(shape)
