"""What the quantized modes share: activations in float16 or bfloat16."""

from __future__ import annotations

from ...core.errors import SpecError


def check_16_bit(mode: str, dtype: str) -> None:
    if dtype not in ("float16", "bfloat16"):
        raise SpecError(f"{mode} needs float16 or bfloat16 activations, not {dtype!r}")
