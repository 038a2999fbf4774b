"""A model's padded twin: the same function with wider matrices, for a quantization mode whose
kernels need dimensions the model does not have (W4A8 AWQ: in and out features multiples of
128 x tp; TensorRT-LLM pads others in its layers, which no checkpoint can hold, and modelopt and
TensorRT-LLM's PyTorch backend refuse them: docs/upstream/w4a8-padding.md).

For a decoder with RMSNorm and rotary attention (the Llama-style families), with h the hidden
size, H heads of d channels over KV key/value heads (g = H / KV query heads per group) and I
the MLP width, the twin has H' = H + g m heads over KV + m groups (the added groups at the end:
each real head keeps its group), hidden h' = H' d where h = H d, and I' the next multiple; every
added row and column is zero, and:

- each RMSNorm weight is w * sqrt(h / h') and its epsilon eps * h / h': the twin's mean square
  over h' channels, whose added ones are zero, is (h / h') times the model's over h, so
  rsqrt((h / h')(ms + eps)) * w sqrt(h / h') = rsqrt(ms + eps) * w;
- an added head's q and k are zero, so its softmax is uniform over v, which is zero: it adds
  nothing, and o_proj's columns for it are zero besides;
- the added MLP rows give silu(0) * 0 = 0.

So the twin's logits are the model's (to float rounding: tests/test_w4a8.py), and a checkpoint
of the twin is a checkpoint of the model. What is written by hand here: transformers has no such
transform.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.errors import ConversionError, SpecError
from ..models.registry import family_for
from ..models.shape import AttentionShape

if TYPE_CHECKING:  # torch is imported where tensors are padded: planning a build needs none
    import torch

#: How far the heads may grow: at most twice the groups (else the twin is refused).
MAX_GROWTH = 2


@dataclass(frozen=True)
class Twin:
    """The padded shape of a model: hidden, heads, KV heads, head size and MLP width, before
    (`hidden`, ...) and after (`to_hidden`, ...)."""

    hidden: int
    heads: int
    kv_heads: int
    head: int
    inter: int
    to_heads: int
    to_kv_heads: int
    to_inter: int

    @property
    def to_hidden(self) -> int:
        return self.to_heads * self.head

    @property
    def ratio(self) -> float:
        return self.hidden / self.to_hidden

    @property
    def slug(self) -> str:
        """Its name in directory names: the hidden width it pads to."""
        return f"pad{self.to_hidden}"

    @classmethod
    def of(cls, config: dict[str, Any], multiple: int, why: str) -> Twin | None:
        """The smallest twin of the Hugging Face `config` whose hidden, q, qkv and MLP widths
        are multiples of `multiple`; None where the model's already are. SpecError,
        naming `why` (what needs the multiple), where no twin is exact or small enough: said
        before any work."""
        trtllm = family_for(config).config(config)  # the widths, under one set of names
        attention = AttentionShape.of(trtllm)
        heads, kv, head = attention.heads, attention.kv_heads, attention.head_size
        hidden, inter = int(trtllm["hidden_size"]), int(trtllm["intermediate_size"])

        def fits(h: int, k: int) -> bool:
            return (h * head) % multiple == 0 and ((h + 2 * k) * head) % multiple == 0

        if fits(heads, kv) and hidden % multiple == 0 and inter % multiple == 0:
            return None
        if hidden != heads * head or heads % kv:
            raise SpecError(
                f"{why}: this model's widths (hidden {hidden}, {heads} heads of {head}) are not "
                f"multiples of {multiple} and cannot be padded exactly: use --dtype int4-awq"
            )
        if "rms_norm_eps" not in config:
            raise SpecError(
                f"{why}: this model's widths are not multiples of {multiple}, and only an "
                "RMSNorm model is padded exactly: use --dtype int4-awq"
            )
        group = heads // kv
        added = next((m for m in range(MAX_GROWTH * kv + 1)
                      if fits(heads + group * m, kv + m)), None)  # fmt: skip
        if added is None:
            raise SpecError(
                f"{why}: no twin of this model with at most {MAX_GROWTH}x its heads has widths "
                f"that are multiples of {multiple}: use --dtype int4-awq"
            )
        return cls(hidden, heads, kv, head, inter, heads + group * added, kv + added,
                   math.ceil(inter / multiple) * multiple)  # fmt: skip

    def config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The twin's Hugging Face config."""
        return {
            **config,
            "hidden_size": self.to_hidden,
            "num_attention_heads": self.to_heads,
            "num_key_value_heads": self.to_kv_heads,
            "head_dim": self.head,
            "intermediate_size": self.to_inter,
            "rms_norm_eps": float(config["rms_norm_eps"]) * self.ratio,
        }

    def tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The twin's tensor `name` (a Llama-style Hugging Face name) of the model's `tensor`."""
        for suffix, pad in self._rules():
            if name.endswith(suffix):
                return pad(tensor)
        raise ConversionError(f"the padded twin has no rule for tensor {name}")

    def _rules(self) -> tuple[tuple[str, Callable[[torch.Tensor], torch.Tensor]], ...]:
        h, q, kv = self.to_hidden, self.to_heads * self.head, self.to_kv_heads * self.head
        inter = self.to_inter

        def norm(t: torch.Tensor) -> torch.Tensor:
            return _pad(t.float() * math.sqrt(self.ratio), (h,)).to(t.dtype)

        def shaped(*shape: int) -> Callable[[torch.Tensor], torch.Tensor]:
            return lambda t: _pad(t, shape[: t.dim()])

        return (
            ("embed_tokens.weight", lambda t: _pad(t, (t.shape[0], h))),
            ("lm_head.weight", lambda t: _pad(t, (t.shape[0], h))),
            ("layernorm.weight", norm),  # input_layernorm, post_attention_layernorm
            ("model.norm.weight", norm),
            ("q_norm.weight", lambda t: t),  # Qwen3: per head, the heads' own width
            ("k_norm.weight", lambda t: t),
            ("q_proj.weight", shaped(q, h)),
            ("q_proj.bias", shaped(q)),
            ("k_proj.weight", shaped(kv, h)),
            ("k_proj.bias", shaped(kv)),
            ("v_proj.weight", shaped(kv, h)),
            ("v_proj.bias", shaped(kv)),
            ("o_proj.weight", shaped(h, q)),
            ("gate_proj.weight", shaped(inter, h)),
            ("up_proj.weight", shaped(inter, h)),
            ("down_proj.weight", shaped(h, inter)),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "hidden": [self.hidden, self.to_hidden],
            "heads": [self.heads, self.to_heads],
            "kv_heads": [self.kv_heads, self.to_kv_heads],
            "intermediate": [self.inter, self.to_inter],
        }


def _pad(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`tensor` zero-padded at the end of each dimension to `shape`."""
    import torch

    out = torch.zeros(shape, dtype=tensor.dtype)
    out[tuple(slice(0, n) for n in tensor.shape)] = tensor
    return out
