"""The one map of dtype names: bytes per element, and torch's dtype (torch imported only when asked)."""

from __future__ import annotations

from typing import Any

#: Bytes per element of the dtypes a checkpoint, an activation or a KV cache can have.
BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "int8": 1, "fp8": 1}
#: The floating-point dtypes a checkpoint is written in.
FLOATS = ("float16", "bfloat16", "float32")


def torch_dtype(name: str) -> Any:
    """torch's dtype of a float dtype name (float16, bfloat16, float32)."""
    import torch  # only where tensors are made: the rest of core stays light

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]
