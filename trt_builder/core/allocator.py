"""The C allocator, told to keep what the process frees for its next allocations.

glibc serves every allocation over 32 MiB (a batch's logits: 400 MB for the default model; a
layer's activations) with a fresh mmap and returns it on free, so each one is faulted in
again, page by page. On the virtual machines these builds run on, that cost more than the
arithmetic: 0.4-0.6 s for 400 MB against 0.03 s to fill memory already mapped, a third of
the default build's recipe and verify. With mmap off and no trimming, freed memory is reused
from the heap. The figures do not change (the same arithmetic on the same values); the
process's resident memory stays at its peak until it exits, which suits a build stage, not a
server, so the pipeline's stages ask for it and `serve` does not.

Written here: mallopt through ctypes, two settings; neither jemalloc nor tcmalloc ships with
Python or torch.
"""

from __future__ import annotations

import ctypes
import functools
import sys

#: glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


@functools.cache
def reuse_freed_memory() -> bool:
    """Keep freed memory for reuse in this process (once; glibc on Linux only: elsewhere, or
    where the C library has no mallopt, nothing changes). Whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
