from __future__ import annotations

import os
from pathlib import Path

import pytest

from trt_builder.core.digests import DigestCache, sha256_file
from trt_builder.core.fsio import atomic_dir, write_json


def test_digest_memo_skips_rehash_until_file_changes(tmp_path: Path) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 1000)
    memo = tmp_path / "memo.json"
    cache = DigestCache(memo)
    first = cache.file(f)
    assert first == sha256_file(f) and cache.hashed_bytes == 1000
    cache.save()

    again = DigestCache(memo)  # a new process: the memo comes from disk
    assert again.file(f) == first
    assert again.hashed_bytes == 0

    f.write_bytes(b"b" * 1000)  # same size, new mtime
    os.utime(f, ns=(1, 1))
    assert again.file(f) != first and again.hashed_bytes == 1000


def test_memo_follows_a_directory_rename(tmp_path: Path) -> None:
    src = tmp_path / "a"
    src.mkdir()
    (src / "x").write_text("x")
    cache = DigestCache(None)
    digest = cache.digest(src)
    dst = tmp_path / "b"
    src.rename(dst)
    cache.move(src, dst)
    before = cache.hashed_bytes
    assert cache.digest(dst) == digest and cache.hashed_bytes == before


def test_a_hard_link_of_a_memoized_file_is_not_read_again(tmp_path: Path) -> None:
    """The Triton repository hard-links the checkpoint's rank files: a 13.5 GB rank file was
    hashed a second time by package (one thread, 13 s on the H200 host)."""
    f = tmp_path / "rank0.safetensors"
    f.write_bytes(b"w" * 4096)
    memo = tmp_path / "memo.json"
    cache = DigestCache(memo)
    digest = cache.file(f)
    cache.save()
    link = tmp_path / "repo" / "rank0.safetensors"
    link.parent.mkdir()
    os.link(f, link)
    again = DigestCache(memo)  # the next stage's process
    assert again.file(link) == digest and again.hashed_bytes == 0
    link.unlink()
    (tmp_path / "repo" / "rank0.safetensors").write_bytes(b"w" * 4096)  # a copy: read
    assert again.file(link) == digest and again.hashed_bytes == 4096


def test_atomic_dir_failure_leaves_nothing(tmp_path: Path) -> None:
    final = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic_dir(final) as work:
        (work / "half").write_text("partial")
        raise RuntimeError("boom")
    assert not final.exists()
    assert os.listdir(tmp_path) == []


def test_atomic_dir_replaces_whole(tmp_path: Path) -> None:
    final = tmp_path / "out"
    with atomic_dir(final) as work:
        (work / "old").write_text("1")
    with atomic_dir(final) as work:
        (work / "new").write_text("2")
    assert sorted(os.listdir(final)) == ["new"]
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_write_json_is_atomic(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    write_json(path, {"a": 1})
    assert path.read_text().strip().startswith("{") and os.listdir(tmp_path) == ["m.json"]
