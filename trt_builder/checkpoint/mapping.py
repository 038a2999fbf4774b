"""How a model is split into ranks (no torch): the mapping of a checkpoint config, and the
tp/pp values a model can take."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.errors import SpecError
from ..models.shape import AttentionShape


@dataclass(frozen=True)
class Mapping:
    tp: int
    pp: int
    layers: int
    heads: int
    kv_heads: int
    head_size: int
    vocab: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Mapping:
        mapping = config.get("mapping") or {}
        attention = AttentionShape.of(config)
        return cls(
            tp=mapping.get("tp_size", 1),
            pp=mapping.get("pp_size", 1),
            layers=config["num_hidden_layers"],
            heads=attention.heads,
            kv_heads=attention.kv_heads,
            head_size=attention.head_size,
            vocab=config["vocab_size"],
        )

    @property
    def world(self) -> int:
        return self.tp * self.pp

    def layer_range(self, pp_rank: int) -> range:
        per = self.layers // self.pp
        return range(pp_rank * per, (pp_rank + 1) * per)

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab // self.tp) * self.tp


def check_mapping(config: dict[str, Any], tp: int, pp: int) -> None:
    """Refuse a tp/pp the model cannot be split into, naming values that work."""
    attention = AttentionShape.of(config)
    heads, kv = attention.heads, attention.kv_heads
    layers = config["num_hidden_layers"]
    inter = config.get("intermediate_size", 4 * config["hidden_size"])
    good_tp = [
        t
        for t in range(1, heads + 1)
        if heads % t == 0 and (kv % t == 0 or t % kv == 0) and inter % t == 0
    ]
    if tp not in good_tp:
        raise SpecError(
            f"--tp {tp} does not divide this model ({heads} attention heads, {kv} KV heads, "
            f"intermediate size {inter}): use one of {', '.join(map(str, good_tp))}"
        )
    if layers % pp:
        good_pp = [p for p in range(1, layers + 1) if layers % p == 0]
        raise SpecError(
            f"--pp {pp} does not divide {layers} layers: use one of {', '.join(map(str, good_pp))}"
        )
