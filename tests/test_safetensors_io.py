"""The streaming reader and writer: byte-identical to the safetensors library, and strict."""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trt_builder.checkpoint import safetensors_io
from trt_builder.checkpoint.safetensors_io import SafetensorsIndex, StreamingWriter
from trt_builder.core.errors import InputError

TENSORS = {
    "b": torch.arange(15, dtype=torch.float32).reshape(3, 5).to(torch.bfloat16),
    "a": torch.tensor([-5, 0, 4, 127], dtype=torch.int8),
    "c": torch.linspace(-1, 1, 7),
    "empty": torch.zeros(0, 4, dtype=torch.float16),
}


def test_writer_matches_the_library_byte_for_byte_in_any_order(tmp_path: Path) -> None:
    save_file(TENSORS, str(tmp_path / "lib.safetensors"), metadata={"format": "pt"})
    library_order = sorted(TENSORS, key=lambda n: (-TENSORS[n].element_size(), n))
    plan = {k: (TENSORS[k].dtype, tuple(TENSORS[k].shape)) for k in library_order}
    writer = StreamingWriter(tmp_path / "ours.safetensors", plan, {"format": "pt"})
    for name in ("c", "empty", "a", "b"):
        writer.write(name, TENSORS[name])
    writer.close()
    assert (tmp_path / "ours.safetensors").read_bytes() == (
        tmp_path / "lib.safetensors"
    ).read_bytes()
    index = SafetensorsIndex([tmp_path / "ours.safetensors"])
    assert all(torch.equal(index.read(k), v) for k, v in TENSORS.items())
    index.close()


def test_writer_refuses_a_wrong_tensor_and_a_missing_one(tmp_path: Path) -> None:
    writer = StreamingWriter(
        tmp_path / "x.safetensors", {"w": (torch.float16, (2, 2)), "v": (torch.float16, (2,))}
    )
    with pytest.raises(ValueError, match="planned shape \\[2, 2\\], got \\[2, 3\\]"):
        writer.write("w", torch.zeros(2, 3))
    writer.write("w", torch.full((2, 2), 1.5))  # cast to the planned float16 in the copy
    with pytest.raises(ValueError, match="1 planned tensor\\(s\\) never written, e.g. v"):
        writer.close()


def _file(tmp_path: Path) -> Path:
    path = tmp_path / "m.safetensors"
    save_file({"x": torch.ones(4, 4), "y": torch.ones(8)}, str(path))
    return path


def _rewrite_header(path: Path, edit: dict) -> None:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header.update(edit)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + length :])


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        ("empty", "is truncated (no safetensors header)"),
        ("huge_header", "has a corrupt safetensors header (length"),
        ("not_json", "corrupt safetensors header (not JSON)"),
        ("truncated_data", "that do not fit its shape [8] F32 (or are misaligned, or past the end"),
        ("misaligned", "has offsets 2..66 that do not fit its shape [4, 4] F32"),
        (
            "malformed",
            "the header entry of tensor x is malformed (needs dtype, shape, data_offsets)",
        ),
        ("overlap", "tensors x and y overlap"),
        ("wrong_size", "that do not fit its shape [4, 4] F32"),
    ],
)
def test_damaged_files_are_refused_with_the_check_named(
    tmp_path: Path, damage: str, needle: str
) -> None:
    path = _file(tmp_path)
    raw = path.read_bytes()
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "huge_header":
        path.write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])
    elif damage == "not_json":
        path.write_bytes(raw[:8] + b"{" * 8 + raw[16:])
    elif damage == "truncated_data":
        path.write_bytes(raw[:-4])
    elif damage == "overlap":
        _rewrite_header(path, {"x": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]},
                               "y": {"dtype": "F32", "shape": [8], "data_offsets": [32, 64]}})  # fmt: skip
    elif damage == "misaligned":
        _rewrite_header(path, {"x": {"dtype": "F32", "shape": [4, 4], "data_offsets": [2, 66]}})
    elif damage == "malformed":
        _rewrite_header(path, {"x": {"dtype": "F32", "shape": [4, 4]}})
    elif damage == "wrong_size":
        _rewrite_header(path, {"x": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}})
    with pytest.raises(InputError) as info:
        SafetensorsIndex([path])
    assert needle in str(info.value)


def test_reader_agrees_with_the_library(tmp_path: Path) -> None:
    path = _file(tmp_path)
    expected = load_file(path)
    index = SafetensorsIndex([path])
    assert sorted(index.names()) == ["x", "y"] and all(
        torch.equal(index.read(k), v) for k, v in expected.items()
    )


def test_a_full_disk_is_an_error_before_any_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    from trt_builder.core.errors import OutputError

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(
        OutputError, match="cannot reserve 2.1 MB for .*No space left on device.*free disk space"
    ):
        StreamingWriter(tmp_path / "x.safetensors", {"w": (torch.float16, (1024, 1024))})


# --- the output stream: small windows so that every path is taken on small tensors ---

GEN = torch.Generator().manual_seed(0)
STREAMED = {  # in the library's order (element size, then name)
    "big": torch.randn(700, 33, generator=GEN),  # 92 KB: many windows, unaligned tail
    "rows": torch.randn(5000, 3, generator=GEN).t(),  # 20 KB rows: larger than a block
    "wide": torch.randn(3, 9000, generator=GEN).t(),  # non-contiguous, written by rows
    "half": torch.randn(31, generator=GEN).to(torch.float16),
    "bytes": torch.arange(-50, 51, dtype=torch.int8),
}


def _direct_supported(directory: Path) -> bool:
    probe = directory / "probe"
    probe.touch()
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_DIRECT))
    except (OSError, AttributeError):
        return False
    finally:
        probe.unlink()
    return True


def _stream(tmp_path: Path, name: str) -> Path:
    plan = {k: (v.dtype, tuple(v.shape)) for k, v in STREAMED.items()}
    with StreamingWriter(tmp_path / name, plan, {"format": "pt"}) as writer:
        for key, tensor in STREAMED.items():
            writer.write(key, tensor)
    return tmp_path / name


@pytest.fixture
def small_windows(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """8 KiB windows and 4 KiB blocks; records every pwrite as (fd, bytes, offset)."""
    monkeypatch.setattr(safetensors_io, "STAGING_BYTES", 4096)
    monkeypatch.setattr(safetensors_io, "WINDOW_BYTES", 8192)
    calls: list[tuple[int, int, int]] = []
    real = os.pwrite

    def spy(fd: int, data: memoryview, offset: int) -> int:
        calls.append((fd, len(data), offset))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", spy)
    return calls


def test_streamed_output_matches_the_library_and_goes_direct_where_allowed(
    tmp_path: Path, small_windows: list[tuple[int, int, int]]
) -> None:
    save_file({k: v.contiguous() for k, v in STREAMED.items()}, str(tmp_path / "lib.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    ours = _stream(tmp_path, "ours.safetensors")
    assert ours.read_bytes() == (tmp_path / "lib.safetensors").read_bytes()
    if not _direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT: only the buffered path ran")
    fds = {fd for fd, _, _ in small_windows}
    assert len(fds) == 2  # the buffered descriptor (the tail) and the O_DIRECT one
    direct = [(n, off) for fd, n, off in small_windows if fd == max(fds)]
    # whole aligned windows, front to back, then only the unaligned tail is buffered
    assert all(n % 4096 == 0 and off % 4096 == 0 for n, off in direct)
    assert sum(n for n, _ in direct) == ours.stat().st_size // 4096 * 4096


def test_a_file_written_front_to_back_is_hashed_on_the_way(
    tmp_path: Path, small_windows: list[tuple[int, int, int]]
) -> None:
    """Many windows, an unaligned tail: the digest handed over is the file's sha256. A write
    out of order hands none (the stage's record then reads the file)."""
    from trt_builder.core.digests import sha256_file

    plan = {k: (v.dtype, tuple(v.shape)) for k, v in STREAMED.items()}
    seen: dict[Path, str] = {}
    for name, order in (("front.st", list(STREAMED)), ("shuffled.st", list(STREAMED)[::-1])):
        with StreamingWriter(tmp_path / name, plan, None, seen.__setitem__) as writer:
            for key in order:
                writer.write(key, STREAMED[key])
    assert seen == {tmp_path / "front.st": sha256_file(tmp_path / "front.st")}
    assert sha256_file(tmp_path / "front.st") == sha256_file(tmp_path / "shuffled.st")


def test_streamed_output_falls_back_to_buffered_writes(
    tmp_path: Path, small_windows: list[tuple[int, int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = _stream(tmp_path, "first.safetensors").read_bytes()
    real_open, real_pwrite = os.open, os.pwrite
    direct_fds: set[int] = set()

    def opening(path: Path, flags: int, *args: int) -> int:
        fd = real_open(path, flags, *args)
        if flags & getattr(os, "O_DIRECT", 0):
            direct_fds.add(fd)
        return fd

    def refusing(fd: int, data: memoryview, offset: int) -> int:
        if fd in direct_fds:  # as a file system with a larger block size would
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "open", opening)
    monkeypatch.setattr(os, "pwrite", refusing)
    assert _stream(tmp_path, "refused.safetensors").read_bytes() == expected

    def no_direct(path: Path, flags: int, *args: int) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    assert _stream(tmp_path, "unsupported.safetensors").read_bytes() == expected


def test_a_write_error_in_the_writer_thread_reaches_the_caller(
    tmp_path: Path, small_windows: list[tuple[int, int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError) as info:
        _stream(tmp_path, "x.safetensors")
    assert info.value.errno == errno.ENOSPC


def test_each_cast_block_is_checked_with_its_source(
    tmp_path: Path, small_windows: list[tuple[int, int, int]]
) -> None:
    source = torch.randn(64, 100, generator=GEN)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    with StreamingWriter(tmp_path / "x.safetensors", {"w": (torch.float16, (64, 100))}) as w:
        w.write("w", source, lambda block, src: seen.append((block.clone(), src.clone())))
    assert len(seen) > 1  # 12.8 KB in blocks of at most 4 KiB
    assert torch.equal(torch.cat([b for b, _ in seen]).view(64, 100), source.half())
    assert torch.equal(torch.cat([s for _, s in seen]).view(64, 100), source)
