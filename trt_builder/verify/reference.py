"""The transformers reference's outputs, kept between verify runs of one model.

Every variant of a model is verified against the same float32 transformers model on the same
prompts and held-out windows, so the reference's half of verify (loading it, its greedy
continuations, its logits and hidden states) is the same work each time. `RecordedReference`
answers the calls verify makes of the model (`model(ids, output_hidden_states=...)`,
`model.generate(...)`) from the model's records (core/records.py: each named by the digest of
everything its content depends on, written whole) made by the first run that made them, and
loads the model only on a call it has not seen. What it returns is what the model returned, to
the bit (tested: a report from the records equals the one computed).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from ..core.records import Records

#: Bump when what a record holds, or how a call is named, changes.
FORMAT = 1


class RecordedReference:
    """The reference model behind `load` (called once, on the first call not on record), with
    its outputs kept in `records` (None: nothing kept)."""

    def __init__(self, load: Callable[[], Any], records: Records | None) -> None:
        self._load, self._model = load, None
        self.records = records or Records(None, "", FORMAT)

    @property
    def model(self) -> Any:
        if self._model is None:
            self._model = self._load()
        return self._model

    def __call__(self, ids: torch.Tensor, output_hidden_states: bool = False) -> Any:
        """The model's forward on `ids`: `.logits` (and `.hidden_states` where asked)."""

        def forward() -> dict[str, torch.Tensor]:
            with torch.inference_mode():
                out = self.model(ids, output_hidden_states=output_hidden_states)
            hidden = (out.hidden_states or ()) if output_hidden_states else ()
            return {
                "logits": out.logits.float(),
                **{f"hidden.{i}": h for i, h in enumerate(hidden)},
            }

        kept = self.records.cached("forward", forward, ids, hidden=output_hidden_states)
        hidden = tuple(kept[f"hidden.{i}"] for i in range(len(kept) - 1))
        return SimpleNamespace(logits=kept["logits"],
                               hidden_states=hidden if output_hidden_states else None)  # fmt: skip

    def generate(self, ids: torch.Tensor, attention_mask: torch.Tensor, **options: Any) -> Any:
        """The model's `generate` (greedy, as verify calls it): the sequences."""

        def generate() -> dict[str, torch.Tensor]:
            return {"sequences": self.model.generate(ids, attention_mask=attention_mask, **options)}

        kept = self.records.cached("generate", generate, ids, attention_mask, **options)
        return kept["sequences"].to(ids.device)
