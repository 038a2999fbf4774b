"""The transformers reference's outputs, kept between verify runs of one model.

Every variant of a model is verified against the same float32 transformers model on the same
prompts and held-out windows, so the reference's half of verify (loading it, its greedy
continuations, its logits and hidden states) is the same work each time. `RecordedReference`
answers the calls verify makes of the model (`model(ids, output_hidden_states=...)`,
`model.generate(...)`) from files written by the first run that made them, and loads the model
only on a call it has not seen. A file's name is the digest of everything its content depends
on: the reference's files, the device, torch's and transformers' releases, this module's format
and the call with its inputs, so a changed model, release or prompt is a new file, never a stale
one; each file is written whole (to a temporary name, then renamed). What it returns is what the
model returned, to the bit (tested: a report from the records equals the one computed).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

#: Bump when what a record holds, or how a call is named, changes.
FORMAT = 1


class RecordedReference:
    """The reference model behind `load` (called once, on the first call not on record), with
    its outputs recorded in `directory` under names derived from `key` (None: nothing kept)."""

    def __init__(self, load: Callable[[], Any], directory: Path | None, key: str) -> None:
        self._load, self._model = load, None
        self.directory, self.key = directory, key

    @property
    def model(self) -> Any:
        if self._model is None:
            self._model = self._load()
        return self._model

    def _record(self, call: str, *tensors: torch.Tensor, **options: Any) -> Path | None:
        if self.directory is None:
            return None
        h = hashlib.sha256(f"{FORMAT}\0{self.key}\0{call}\0{sorted(options.items())}".encode())
        for t in tensors:
            t = t.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.numpy().tobytes())
        return self.directory / f"{call}-{h.hexdigest()[:32]}.safetensors"

    def _keep(self, path: Path | None, tensors: dict[str, torch.Tensor]) -> None:
        if path is None:
            return
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        os.close(fd)
        try:
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp)
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)

    def __call__(self, ids: torch.Tensor, output_hidden_states: bool = False) -> Any:
        """The model's forward on `ids`: `.logits` (and `.hidden_states` where asked)."""
        from safetensors.torch import load_file

        path = self._record("forward", ids, hidden=output_hidden_states)
        if path is not None and path.is_file():
            kept = load_file(path)
            hidden = tuple(kept[f"hidden.{i}"] for i in range(len(kept) - 1))
            return SimpleNamespace(logits=kept["logits"],
                                   hidden_states=hidden if output_hidden_states else None)  # fmt: skip
        with torch.inference_mode():
            out = self.model(ids, output_hidden_states=output_hidden_states)
        tensors = {"logits": out.logits.float()}
        for i, h in enumerate((out.hidden_states or ()) if output_hidden_states else ()):
            tensors[f"hidden.{i}"] = h
        self._keep(path, tensors)
        return out

    def generate(self, ids: torch.Tensor, attention_mask: torch.Tensor, **options: Any) -> Any:
        """The model's `generate` (greedy, as verify calls it): the sequences."""
        from safetensors.torch import load_file

        path = self._record("generate", ids, attention_mask, **options)
        if path is not None and path.is_file():
            return load_file(path)["sequences"].to(ids.device)
        out = self.model.generate(ids, attention_mask=attention_mask, **options)
        self._keep(path, {"sequences": out})
        return out
