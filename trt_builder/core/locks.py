"""A lock a build holds on its target, naming its holder to anyone who waits."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from .errors import LockBusy


@contextmanager
def locked(path: Path, timeout: float) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    owner = path.with_name(path.name + ".owner")
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=timeout)
    except Timeout:
        held_by = owner.read_text().strip() if owner.is_file() else "another process"
        raise LockBusy(
            f"{path.parent} is being built by {held_by}: wait for it, or raise --lock-timeout"
        ) from None
    try:
        owner.write_text(
            f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}\n"
        )
        yield
    finally:
        owner.unlink(missing_ok=True)
        lock.release()
