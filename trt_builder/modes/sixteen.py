"""What the quantized modes share: activations in float16 or bfloat16."""

from __future__ import annotations

from ..core.errors import SpecError


def check_16_bit(mode: str, dtype: str) -> None:
    if dtype not in ("float16", "bfloat16"):
        raise SpecError(f"{mode} needs float16 or bfloat16 activations, not {dtype!r}")


def sixteen_bit(dtype: str) -> str:
    """A checkpoint's dtype as a quantized mode's activations: float16 for one in another
    dtype (the recipe search simulates its candidates in float32)."""
    return dtype if dtype in ("float16", "bfloat16") else "float16"
