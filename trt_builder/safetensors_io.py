"""Streaming safetensors I/O: read one tensor at a time with pread, write one tensor at a time.

Written by hand because the safetensors library saves whole dicts (the model would have to fit in
memory) and reads through a memory map, whose touched pages count towards the process's RSS for
as long as the file is open. Here a converter holds one tensor at a time; see docs/design.md.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import InputError

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


class SafetensorsIndex:
    """Every tensor of a set of safetensors files, by name, read on demand."""

    def __init__(self, files: list[Path]) -> None:
        self.entries: dict[str, TensorEntry] = {}
        for path in files:
            header, base = read_header(path)
            size = path.stat().st_size
            spans = []
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                begin, end = info["data_offsets"]
                shape = tuple(int(d) for d in info["shape"])
                dtype = info["dtype"]
                if dtype not in DTYPES:
                    raise InputError(f"{path.name}: tensor {name} has unsupported dtype {dtype}")
                need = math.prod(shape) * torch.empty((), dtype=DTYPES[dtype]).element_size()
                if end - begin != need or base + end > size or begin < 0:
                    raise InputError(
                        f"{path.name}: tensor {name} has offsets {begin}..{end} that do not fit its "
                        f"shape {list(shape)} {dtype} or the file: the file is corrupt or truncated"
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

    def read(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        fd = self._fds.get(entry.path)
        if fd is None:
            fd = self._fds[entry.path] = os.open(entry.path, os.O_RDONLY)
        buf = bytearray(entry.end - entry.start)
        view = memoryview(buf)
        done = 0
        while done < len(buf):
            n = os.preadv(fd, [view[done:]], entry.start + done)
            if n == 0:
                raise InputError(
                    f"{entry.path.name} ended early while reading {name}: it is truncated"
                )
            done += n
        if not buf:
            return torch.empty(entry.shape, dtype=DTYPES[entry.dtype])
        return torch.frombuffer(buf, dtype=DTYPES[entry.dtype]).reshape(entry.shape)

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
    order. `close` checks that every planned tensor was written.
    """

    def __init__(
        self,
        path: Path,
        plan: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        def size(item: tuple[torch.dtype, tuple[int, ...]]) -> int:
            return math.prod(item[1]) * torch.empty((), dtype=item[0]).element_size()

        # The safetensors library's order: larger element types first, then by name.
        order = sorted(plan, key=lambda n: (-torch.empty((), dtype=plan[n][0]).element_size(), n))
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
        self.fh = open(path, "wb")
        self.fh.write(struct.pack("<Q", len(raw)) + raw)
        self.fh.truncate(self.base + offset)
        self.pending = set(plan)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        dtype, shape = self.plan[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name}: planned {dtype} {list(shape)}, got {tensor.dtype} {list(tensor.shape)}"
            )
        start, _ = self.offsets[name]
        self.fh.seek(self.base + start)
        self.fh.write(tensor.contiguous().view(torch.uint8).reshape(-1).numpy().data)
        self.pending.discard(name)

    def close(self) -> None:
        self.fh.close()
        if self.pending:
            raise ValueError(
                f"{self.path.name}: {len(self.pending)} planned tensor(s) never written, e.g. {min(self.pending)}"
            )
