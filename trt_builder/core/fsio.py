"""Atomic output: files and directories appear whole or not at all."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

TMP_MARK = ".tmp-"
OLD_MARK = ".old-"


def fsync_tree(root: Path) -> None:
    """Flush every file under root (and the directories, which hold its symbolic links) to
    disk."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            if os.path.islink(os.path.join(dirpath, name)):  # its directory's fsync keeps it
                continue
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically: a temporary sibling, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{TMP_MARK}{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, sort_keys=True, default=str)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    """Write text atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{TMP_MARK}{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def clean_leftovers(final: Path) -> None:
    """Remove temporary or superseded siblings a killed run left next to `final`."""
    if not final.parent.is_dir():
        return
    for sibling in final.parent.iterdir():
        name = sibling.name
        if name.startswith(f".{final.name}{TMP_MARK}") or name.startswith(
            f".{final.name}{OLD_MARK}"
        ):
            if sibling.is_symlink():
                sibling.unlink(missing_ok=True)
            else:
                shutil.rmtree(sibling, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(final: Path, place: Callable[[Path, Path], None] | None = None) -> Iterator[Path]:
    """Yield an empty temporary sibling of `final`; on success it replaces `final` whole
    (or `place(tmp, final)` puts it where it belongs, e.g. a new published version).

    On any exception the temporary directory is removed and `final` is left as it was.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(final)
    tmp = final.with_name(f".{final.name}{TMP_MARK}{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        if place is not None:
            place(tmp, final)
            return
        old = None
        if final.exists():
            old = final.with_name(f".{final.name}{OLD_MARK}{uuid.uuid4().hex[:8]}")
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link src to dst where the filesystem allows, else copy (never a symlink)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def replace_symlink(link: Path, target: Path) -> None:
    """Point `link` at `target` (relative, so the tree can be mounted elsewhere) atomically:
    a new link beside it, renamed over it."""
    tmp = link.with_name(f".{link.name}{TMP_MARK}{uuid.uuid4().hex[:8]}")
    os.symlink(os.path.relpath(target, link.parent), tmp)
    try:
        os.replace(tmp, link)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(link.parent)
