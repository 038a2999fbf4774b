"""sha256 digests of files and directories, memoized by (path, size, mtime, inode); a hard link
of a memoized file (the Triton repository links the checkpoint's rank files) is found by its
device and inode.

The files of a directory are hashed on several threads (hashlib lets go of the GIL): a model's
shards take the time of the largest, not of their sum, on a host with the cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .fsio import write_json

_CHUNK = 8 << 20
_THREADS = min(8, os.cpu_count() or 1)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def copy_hashed(src: Path, dst: Path) -> str:
    """Copy src to dst (with its timestamps, as shutil.copy2) and return the sha256 of the bytes
    copied: one read of the file serves both, where a copy and then a digest would read it
    twice (13.5 GB of a 7B model's weights: about 13 s on an H200 host)."""
    import shutil

    h = hashlib.sha256()
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(_CHUNK):
            h.update(chunk)
            fout.write(chunk)
    shutil.copystat(src, dst)
    return h.hexdigest()


def sha256_json(data: object) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


class DigestCache:
    """A file-digest memo kept as JSON; an entry counts only while size, mtime and inode agree."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._entries: dict[str, dict] = {}
        self._dirty = False
        self._mutex = threading.Lock()
        self.hashed_bytes = 0  # bytes actually read this process: 0 on a fully memoized rerun
        self._forgotten: tuple[str, ...] = ()  # prefixes of removed directories (gc)
        self._by_inode: dict[tuple[int, int], dict] | None = None  # built on first need
        if path is not None and path.is_file():
            try:
                self._entries = json.loads(path.read_text())
            except (OSError, ValueError):
                self._entries = {}  # a damaged memo is only a slower run

    def known(self, path: Path) -> str | None:
        """The memoized digest of `path` while its size, mtime and inode agree, or of another
        name of the same file (a hard link: same device and inode); else None."""
        path = path.resolve()
        st = path.stat()
        stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
        with self._mutex:
            hit = self._entries.get(str(path))
            if not (hit and all(hit.get(k) == v for k, v in stamp.items())):
                hit = self._linked(stamp | {"dev": st.st_dev})
                if hit is not None:
                    self._entries[str(path)] = dict(hit)
                    self._dirty = True
        return None if hit is None else str(hit["sha256"])

    def _linked(self, stamp: dict[str, int]) -> dict | None:
        """An entry for the file with this device, inode, size and mtime (under the mutex)."""
        if self._by_inode is None:
            self._by_inode = {}
            for entry in self._entries.values():
                if "dev" in entry:
                    self._by_inode[(entry["dev"], entry["ino"])] = entry
        hit = self._by_inode.get((stamp["dev"], stamp["ino"]))
        if hit and all(hit.get(k) == v for k, v in stamp.items()):
            return hit
        return None

    def _record(self, key: str, st: os.stat_result, digest: str) -> None:
        """Memoize `digest` for the file `key` whose stat is `st` (under the mutex)."""
        entry = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino,
                 "dev": st.st_dev, "sha256": digest}  # fmt: skip
        self._entries[key] = entry
        if self._by_inode is not None:
            self._by_inode[(st.st_dev, st.st_ino)] = entry
        self._dirty = True

    def file(self, path: Path) -> str:
        path = path.resolve()
        hit = self.known(path)
        if hit is not None:
            return hit
        st = path.stat()
        digest = sha256_file(path)
        with self._mutex:
            self.hashed_bytes += st.st_size
            self._record(str(path), st, digest)
        return digest

    def remember(self, path: Path, digest: str) -> None:
        """Record the digest of a file just written whose bytes were hashed on the way."""
        path = path.resolve()
        st = path.stat()
        with self._mutex:
            self._record(str(path), st, digest)

    def files(self, paths: list[Path]) -> list[str]:
        """The digests of `paths`, in order; those not memoized hashed on several threads."""
        if len(paths) < 2 or _THREADS < 2:
            return [self.file(p) for p in paths]
        with ThreadPoolExecutor(_THREADS, thread_name_prefix="digest") as pool:
            return list(pool.map(self.file, paths))

    def tree(self, root: Path, *, exclude: tuple[str, ...] = ()) -> dict[str, str]:
        """Digest of every regular file under root, by relative posix path; a symbolic link's
        is its target's path (what the tree holds: the llmapi repository links the NGC
        container's template, which need not exist here)."""
        found: dict[str, Path] = {}
        links: dict[str, str] = {}
        for dirpath, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted(files):
                full = Path(dirpath, name)
                rel = full.relative_to(root).as_posix()
                if rel in exclude:
                    continue
                if full.is_symlink():
                    links[rel] = sha256_json({"symlink": os.readlink(full)})
                else:
                    found[rel] = full
        digests = dict(zip(found, self.files(list(found.values())), strict=True))
        return dict(sorted({**digests, **links}.items()))

    def digest(self, target: Path, *, exclude: tuple[str, ...] = ()) -> str:
        """One digest for a file or a directory tree."""
        if target.is_dir():
            return sha256_json(self.tree(target, exclude=exclude))
        return self.file(target)

    def move(self, old_root: Path, new_root: Path) -> None:
        """Carry memo entries over a directory rename (same inodes, so no rehash is needed)."""
        old_prefix, new_prefix = f"{old_root.resolve()}{os.sep}", f"{new_root.resolve()}{os.sep}"
        with self._mutex:
            for key in [k for k in self._entries if k.startswith(old_prefix)]:
                self._entries[new_prefix + key[len(old_prefix) :]] = self._entries.pop(key)
                self._dirty = True

    def forget(self, roots: list[Path]) -> None:
        """Drop the entries of files under `roots` (directories gc removed), here and on disk."""
        prefixes = tuple(f"{Path(r).resolve()}{os.sep}" for r in roots)
        with self._mutex:
            for key in [k for k in self._entries if k.startswith(prefixes)]:
                del self._entries[key]
            self._forgotten += prefixes
            self._dirty = True

    def save(self) -> None:
        """Merge this process's entries into the memo on disk (other builds may have added some)."""
        if self.path is None or not self._dirty:
            return
        from filelock import FileLock

        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._mutex, FileLock(str(self.path) + ".lock"):
            try:
                on_disk = json.loads(self.path.read_text())
            except (OSError, ValueError):
                on_disk = {}
            merged = {**on_disk, **self._entries}
            if self._forgotten:
                merged = {k: v for k, v in merged.items() if not k.startswith(self._forgotten)}
            write_json(self.path, merged)
            self._dirty = False
