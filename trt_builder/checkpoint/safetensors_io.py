"""Streaming safetensors I/O: one tensor at a time, in and out.

Written by hand because the safetensors library saves whole dicts (the model would have to fit
in memory) and maps whole files, whose touched pages count towards the process's RSS for as long
as the file is open. Here each input tensor is mapped on its own and unmapped once done; output
is cast a block at a time into two reused windows that a writer thread sends to the file
(O_DIRECT where the file system allows), so the process holds about one tensor plus the
windows; see docs/design.md.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import mmap
import os
import struct
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.errors import InputError, OutputError

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
    "F8_E4M3": torch.float8_e4m3fn,
    "BOOL": torch.bool,
}
CODES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 << 20  # the safetensors library's own limit
#: At most this many bytes are cast per block (one check, one slice of the source at a time).
STAGING_BYTES = 4 << 20
#: Bytes per write to the output file (two windows of this size, plus a block, per file).
WINDOW_BYTES = 16 << 20

#: A check run on each block as written: (block in the target dtype, the source it came from).
Check = Callable[[torch.Tensor, torch.Tensor], None]


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


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


class _OutputStream:
    """Bytes appended to a file through two page-aligned windows; a full window is written by a
    background thread while the other fills.

    Where the file system allows, windows go out with O_DIRECT: the bytes go from the window to
    the disk without passing through the page cache, which would first have to find, zero and
    later write back a fresh page for every 4 KiB (on a small host that costs more CPU than the
    cast itself; docs/benchmarks.md). The unaligned tail, a write out of order, or a file system
    that refuses O_DIRECT use ordinary buffered writes.

    The windows of a file written front to back are also hashed, in order, by a second thread:
    the stage's record then needs no second read of a file of many GB (`sha256`).
    """

    ALIGN = 4096

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.direct: int | None = None
        if hasattr(os, "O_DIRECT"):
            try:
                self.direct = os.open(path, os.O_WRONLY | os.O_DIRECT)
            except OSError:
                self.direct = None  # e.g. tmpfs before Linux 6.6: buffered writes
        self.windows = [self._window(WINDOW_BYTES + STAGING_BYTES) for _ in range(2)]
        self.pending: list[list[Future[None]]] = [[], []]
        self.turn = 0
        self.start = 0  # file offset of the current window's first byte
        self.fill = 0
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="safetensors-writer")
        self.hasher: Any = hashlib.sha256()  # None once a write comes out of order
        self.hashed = 0  # bytes handed to the hasher, all from offset 0 on
        self.hash_pool = ThreadPoolExecutor(1, thread_name_prefix="safetensors-hasher")

    @staticmethod
    def _window(size: int) -> torch.Tensor:
        return torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)  # page-aligned

    @property
    def position(self) -> int:
        return self.start + self.fill

    def reserve(self, count: int) -> torch.Tensor:
        """The next `count` bytes of the current window, to be filled and then committed."""
        window = self.windows[self.turn]
        if self.fill + count > window.numel():  # a block larger than STAGING_BYTES
            self._emit(self.fill - self.fill % self.ALIGN)  # keeps the window's start aligned
            window = self.windows[self.turn]
            if self.fill + count > window.numel():
                bigger = self._window(self.fill + count)
                bigger[: self.fill].copy_(window[: self.fill])
                window = self.windows[self.turn] = bigger
        return window[self.fill : self.fill + count]

    def commit(self, count: int) -> None:
        self.fill += count
        if self.fill >= WINDOW_BYTES:
            self._emit(WINDOW_BYTES)

    def seek(self, offset: int) -> None:
        """Continue at `offset` (a write out of order): buffered writes from here on."""
        if offset != self.position:
            self._emit(self.fill)
            self.drain()
            self._close_direct()
            self.hasher = None
            self.start, self.fill = offset, 0

    @property
    def sha256(self) -> str | None:
        """The digest of the bytes written from offset 0 on, where they came in order."""
        return None if self.hasher is None else self.hasher.hexdigest()

    def _emit(self, count: int) -> None:
        """Hand the first `count` bytes of the current window to the writer thread and carry
        the rest into the other window, once that one's last write is done."""
        other = 1 - self.turn
        for job in self.pending[other]:
            job.result()
        self.pending[other] = []
        rest = self.fill - count
        source, target = self.windows[self.turn], self.windows[other]
        if rest > target.numel():
            target = self.windows[other] = self._window(rest)
        target[:rest].copy_(source[count : self.fill])
        jobs = [self.pool.submit(self._write, source, count, self.start)]
        if self.hasher is not None and self.start == self.hashed:
            jobs.append(self.hash_pool.submit(self.hasher.update, source.numpy().data[:count]))
            self.hashed += count
        self.pending[self.turn] = jobs
        self.turn, self.start, self.fill = other, self.start + count, rest

    def _write(self, window: torch.Tensor, count: int, offset: int) -> None:
        data = window.numpy().data[:count]
        aligned = count - count % self.ALIGN if offset % self.ALIGN == 0 else 0
        if self.direct is not None and aligned:
            try:
                _pwrite_all(self.direct, data[:aligned], offset)
                data, offset = data[aligned:], offset + aligned
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._close_direct()  # a larger block size than we align to: buffered
        _pwrite_all(self.fd, data, offset)

    def drain(self) -> None:
        for i, jobs in enumerate(self.pending):
            self.pending[i] = []
            for job in jobs:
                job.result()  # the writer thread's error (a full disk, say)

    def _close_direct(self) -> None:
        direct, self.direct = self.direct, None
        if direct is not None:
            os.close(direct)

    def close(self, *, flush: bool) -> None:
        try:
            if flush:
                self._emit(self.fill)
                self.drain()
            else:  # already failing: the file is discarded, its write errors do not matter
                for jobs in self.pending:
                    for job in jobs:
                        job.exception()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.hash_pool.shutdown(wait=True, cancel_futures=True)
            self._close_direct()


class StreamingWriter:
    """Writes one safetensors file whose tensor names, dtypes and shapes are known up front.

    Data is laid out in the plan's order (the safetensors library sorts by element size, then
    name; pass a plan in that order to get its exact bytes). Writing in that order streams the
    file front to back through `_OutputStream`; tensors may also come in any other order, at
    some cost in speed. `close` checks that every planned tensor was written, and hands a file
    written front to back to `remember` with its sha256 (DigestCache.remember).
    """

    def __init__(
        self,
        path: Path,
        plan: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
        remember: Callable[[Path, str], None] | None = None,
    ) -> None:
        def size(item: tuple[torch.dtype, tuple[int, ...]]) -> int:
            return math.prod(item[1]) * torch.empty((), dtype=item[0]).element_size()

        header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        self.offsets: dict[str, tuple[int, int]] = {}
        for name, item in plan.items():
            end = offset + size(item)
            header[name] = {
                "dtype": CODES[item[0]],
                "shape": list(item[1]),
                "data_offsets": [offset, end],
            }
            self.offsets[name] = (offset, end)
            offset = end
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw = struct.pack("<Q", len(raw) + -len(raw) % 8) + raw + b" " * (-len(raw) % 8)
        self.plan = plan
        self.base = len(raw)
        self.size = self.base + offset
        self.path = path
        self.remember = remember
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            # Reserve the blocks now: a full disk then fails here, with a clear error, before
            # any time is spent converting.
            os.posix_fallocate(self.fd, 0, self.base + offset)
        except OSError as exc:
            os.close(self.fd)
            raise OutputError(
                f"cannot reserve {_size(self.base + offset)} for {path} ({exc.strerror}): "
                "free disk space or choose another --out"
            ) from None
        self.stream = _OutputStream(self.fd, path)
        self.stream.reserve(len(raw)).copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        self.stream.commit(len(raw))
        self.pending = set(plan)

    def write(
        self, name: str, tensor: torch.Tensor | list[torch.Tensor], check: Check | None = None
    ) -> None:
        """Write `tensor` — or parts to concatenate on dim 0 — at its place, in any layout.

        The parts are cast to the planned dtype a block of rows at a time, straight into the
        output window. `check(block, source_block)` sees each cast block, with the slice of the
        source it came from, while it is still in the cache and before it is written.
        """
        dtype, shape = self.plan[name]
        parts = tensor if isinstance(tensor, list) else [tensor]
        got = (
            tuple(parts[0].shape)
            if len(parts) == 1
            else (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        )
        if got != shape:
            raise ValueError(f"{name}: planned shape {list(shape)}, got {list(got)}")
        self.stream.seek(self.base + self.offsets[name][0])
        item = torch.empty((), dtype=dtype).element_size()
        for part in parts:
            if part.numel() == 0:
                continue
            # Blocks of whole rows (of the flattened tensor where its layout allows).
            rows = part.reshape(-1) if part.is_contiguous() else part
            row_bytes = math.prod(rows.shape[1:]) * item
            step = max(1, STAGING_BYTES // row_bytes)
            for row in range(0, rows.shape[0], step):
                source = rows[row : row + step]
                count = source.numel() * item
                block = self.stream.reserve(count).view(dtype).view(source.shape)
                block.copy_(source)
                if check is not None:
                    check(block, source)
                self.stream.commit(count)
        self.pending.discard(name)

    def __enter__(self) -> StreamingWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # the caller's atomic directory discards the partial file
            try:
                self.stream.close(flush=False)
            finally:
                os.close(self.fd)

    def close(self) -> None:
        try:
            self.stream.close(flush=True)
        finally:
            os.close(self.fd)
        if self.pending:
            raise ValueError(
                f"{self.path.name}: {len(self.pending)} planned tensor(s) never written, e.g. {min(self.pending)}"
            )
        digest = self.stream.sha256
        if self.remember is not None and digest is not None and self.stream.hashed == self.size:
            self.remember(self.path, digest)
