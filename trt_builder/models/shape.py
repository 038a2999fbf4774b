"""The attention shape of a model config: heads, KV heads and head size, read in one place.

It reads a TensorRT-LLM checkpoint config (`head_size`) and an HF config (`head_dim`) alike;
neither names the other's key. KV heads default to the heads (no GQA), the head size to
hidden / heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AttentionShape:
    heads: int
    kv_heads: int
    head_size: int

    @classmethod
    def of(cls, config: dict[str, Any]) -> AttentionShape:
        heads = config["num_attention_heads"]
        head = config.get("head_size") or config.get("head_dim") or config["hidden_size"] // heads
        return cls(heads, config.get("num_key_value_heads") or heads, head)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_size

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_size
