"""The float model's outputs, kept between stages and builds of one model.

Every variant of a model asks the same float model the same questions: verify its reference
outputs on the same prompts and held-out windows (verify/reference.py), every recipe search the
same text the model samples itself (modes/fp8/recipe/search.py `_texts`). `Records` names a
file for each such call by the digest of everything its content depends on (the model's files,
the device, torch's and transformers' releases, the caller's format, the call and its inputs),
so a changed model, release or input is a new file, never a stale one, and writes each file
whole (to a temporary name, then renamed). They live in the model revision's `reference/`
(shared by its variants; `gc` treats it as the revision's).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .digests import sha256_json
from .stage import BuildContext, digest_inputs
from .versions import tool_versions

if TYPE_CHECKING:
    import torch

#: The directory of a model revision that holds its records.
RECORDS_DIR = "reference"
#: The releases a record depends on.
TOOLS = ("torch", "transformers")


class Records:
    """Files in `directory` (None: nothing kept) named from `key` and each call; `format`: the
    caller's, bumped when what its records hold changes."""

    def __init__(self, directory: Path | None, key: str, format: int) -> None:
        self.directory, self.key, self.format = directory, key, format

    def _path(self, call: str, *tensors: torch.Tensor, **options: Any) -> Path | None:
        """The file that holds `call` on `tensors` with `options` (None where nothing is kept)."""
        if self.directory is None:
            return None
        h = hashlib.sha256(f"{self.format}\0{self.key}\0{call}\0{sorted(options.items())}".encode())
        for t in tensors:
            t = t.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.numpy().tobytes())
        return self.directory / f"{call}-{h.hexdigest()[:32]}.safetensors"

    @staticmethod
    def _load(path: Path | None) -> dict[str, torch.Tensor] | None:
        """The tensors kept in `path`, or None where there is no such record."""
        if path is None or not path.is_file():
            return None
        from safetensors.torch import load_file

        return load_file(path)

    @staticmethod
    def _keep(path: Path | None, tensors: dict[str, torch.Tensor]) -> None:
        """Write `tensors` to `path` whole (nothing where `path` is None)."""
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

    def cached(
        self,
        call: str,
        compute: Callable[[], dict[str, torch.Tensor]],
        *tensors: torch.Tensor,
        **options: Any,
    ) -> dict[str, torch.Tensor]:
        """`compute()`'s tensors, from the record where one is kept, else computed and kept."""
        path = self._path(call, *tensors, **options)
        kept = self._load(path)
        if kept is None:
            kept = compute()
            self._keep(path, kept)
        return kept


def model_records(ctx: BuildContext, device: str, format: int, hf: Path | None = None) -> Records:
    """The records of the float model in `hf` (default: the build's; a twin of it, where a mode
    computes on one, has records of its own) run on `device` (resolved: cpu or cuda)."""
    key = sha256_json(
        {
            "hf": digest_inputs(ctx, {"hf": hf or ctx.layout.hf})["hf"],
            "device": device,
            "tools": tool_versions(TOOLS),
        }
    )
    return Records(ctx.layout.model_dir / RECORDS_DIR, key, format)
