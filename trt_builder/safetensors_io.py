"""Streaming safetensors I/O: one tensor at a time, in and out.

Written by hand because the safetensors library saves whole dicts (the model would have to fit
in memory) and maps whole files, whose touched pages count towards the process's RSS for as long
as the file is open. Here each tensor is mapped on its own, read or written in place (a cast
happens in the copy into the output file's pages), and unmapped once done, so the page cache
does the buffering and the process holds about one tensor; see docs/design.md.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import InputError, OutputError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
CODES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 << 20  # the safetensors library's own limit


@dataclass(frozen=True)
class TensorEntry:
    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header, data start) of a safetensors file, with its offsets checked against the file."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise InputError(f"{path.name} is truncated (no safetensors header): re-fetch it")
        (length,) = struct.unpack("<Q", raw)
        if length > MAX_HEADER or 8 + length > size:
            raise InputError(
                f"{path.name} has a corrupt safetensors header (length {length}): re-fetch it"
            )
        try:
            header = json.loads(fh.read(length))
        except ValueError:
            raise InputError(
                f"{path.name} has a corrupt safetensors header (not JSON): re-fetch it"
            ) from None
    return header, 8 + length


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _map(fd: int, start: int, end: int, *, access: int) -> tuple[mmap.mmap, int]:
    """A mapping of bytes start..end of a file (from the page boundary below start)."""
    base = start - start % mmap.ALLOCATIONGRANULARITY
    return mmap.mmap(fd, end - base, offset=base, access=access), start - base


class SafetensorsIndex:
    """Every tensor of a set of safetensors files, by name, read on demand."""

    def __init__(self, files: list[Path]) -> None:
        self.entries: dict[str, TensorEntry] = {}
        for path in files:
            header, base = read_header(path)
            size = path.stat().st_size
            spans = []
            if not isinstance(header, dict):
                raise InputError(
                    f"{path.name} has a corrupt safetensors header (not a table): re-fetch it"
                )
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                try:
                    begin, end = (int(v) for v in info["data_offsets"])
                    shape = tuple(int(d) for d in info["shape"])
                    dtype = str(info["dtype"])
                except (KeyError, TypeError, ValueError):
                    raise InputError(
                        f"{path.name}: the header entry of tensor {name} is malformed (needs dtype, "
                        "shape, data_offsets): the file is corrupt"
                    ) from None
                if dtype not in DTYPES:
                    raise InputError(f"{path.name}: tensor {name} has unsupported dtype {dtype}")
                item = torch.empty((), dtype=DTYPES[dtype]).element_size()
                need = math.prod(shape) * item
                if end - begin != need or base + end > size or begin < 0 or begin % item:
                    raise InputError(
                        f"{path.name}: tensor {name} has offsets {begin}..{end} that do not fit its "
                        f"shape {list(shape)} {dtype} (or are misaligned, or past the end of the "
                        "file): the file is corrupt or truncated"
                    )
                spans.append((begin, end, name))
                if name in self.entries:
                    raise InputError(
                        f"tensor {name} appears in two files ({self.entries[name].path.name}, {path.name})"
                    )
                self.entries[name] = TensorEntry(path, dtype, shape, base + begin, base + end)
            spans.sort()
            for (_, prev_end, prev), (begin, _, name) in zip(spans, spans[1:], strict=False):
                if begin < prev_end:
                    raise InputError(
                        f"{path.name}: tensors {prev} and {name} overlap: the file is corrupt"
                    )
        self._fds: dict[Path, int] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def read(self, name: str) -> torch.Tensor:
        """The tensor as a view of the file's pages (nothing is copied); the pages are unmapped,
        and leave the process's RSS, when the last view of the tensor is freed."""
        entry = self.entries[name]
        dtype = DTYPES[entry.dtype]
        if entry.end == entry.start:
            return torch.empty(entry.shape, dtype=dtype)
        mm, skip = _map(self._fd(entry.path), entry.start, entry.end, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(mm, dtype=torch.uint8, offset=skip, count=entry.end - entry.start)
        return flat.view(dtype).reshape(entry.shape)

    def prefetch(self, names: tuple[str, ...]) -> None:
        """Ask the kernel to start reading these tensors into the page cache (non-blocking)."""
        for name in names:
            entry = self.entries[name]
            if entry.end > entry.start:
                mm, _ = _map(self._fd(entry.path), entry.start, entry.end, access=mmap.ACCESS_READ)
                mm.madvise(mmap.MADV_WILLNEED)
                mm.close()

    def __enter__(self) -> SafetensorsIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class StreamingWriter:
    """Writes one safetensors file whose tensor names, dtypes and shapes are known up front.

    The header is written first; each tensor's bytes are then written at its offset, in any
    order. Data is laid out in the plan's order, so writing in that order appends sequentially
    (the safetensors library sorts by element size, then name; pass a plan in that order to
    get its exact bytes). `close` checks that every planned tensor was written.
    """

    def __init__(
        self,
        path: Path,
        plan: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        def size(item: tuple[torch.dtype, tuple[int, ...]]) -> int:
            return math.prod(item[1]) * torch.empty((), dtype=item[0]).element_size()

        order = list(plan)
        header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        self.offsets: dict[str, tuple[int, int]] = {}
        for name in order:
            dtype, shape = plan[name]
            end = offset + size(plan[name])
            header[name] = {
                "dtype": CODES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, end],
            }
            self.offsets[name] = (offset, end)
            offset = end
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.plan = plan
        self.base = 8 + len(raw)
        self.path = path
        self.fh = open(path, "w+b")  # noqa: SIM115  (closed by close())
        self.fh.write(struct.pack("<Q", len(raw)) + raw)
        self.fh.flush()
        try:
            # Reserve the blocks now: a full disk then fails here, as an error, instead of
            # killing the process with SIGBUS when a write through a mapping finds no space.
            os.posix_fallocate(self.fh.fileno(), 0, self.base + offset)
        except OSError as exc:
            self.fh.close()
            raise OutputError(
                f"cannot reserve {_size(self.base + offset)} for {path} ({exc.strerror}): "
                "free disk space or choose another --out"
            ) from None
        self.pending = set(plan)

    def write(self, name: str, tensor: torch.Tensor | list[torch.Tensor]) -> None:
        """Copy `tensor` — or parts to concatenate on dim 0 — into its place, in any layout;
        the cast to the planned dtype happens in the copy."""
        dtype, shape = self.plan[name]
        parts = tensor if isinstance(tensor, list) else [tensor]
        got = (
            tuple(parts[0].shape)
            if len(parts) == 1
            else (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        )
        if got != shape:
            raise ValueError(f"{name}: planned shape {list(shape)}, got {list(got)}")
        start, end = self.offsets[name]
        if end > start:
            mm, skip = _map(
                self.fh.fileno(), self.base + start, self.base + end, access=mmap.ACCESS_WRITE
            )
            target = torch.frombuffer(mm, dtype=torch.uint8, offset=skip, count=end - start)
            view = target.view(dtype).reshape(shape)
            row = 0
            for part in parts:
                if len(parts) == 1:
                    view.copy_(part)
                else:
                    view[row : row + part.shape[0]].copy_(part)
                    row += part.shape[0]
            del view
            del target  # unmaps: the pages stay in the page cache, dirty, until written back
        self.pending.discard(name)

    def __enter__(self) -> StreamingWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.fh.close()  # the caller's atomic directory discards the partial file

    def close(self) -> None:
        self.fh.close()
        if self.pending:
            raise ValueError(
                f"{self.path.name}: {len(self.pending)} planned tensor(s) never written, e.g. {min(self.pending)}"
            )
