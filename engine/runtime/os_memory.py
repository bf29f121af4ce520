"""The process's heap and the operating system (glibc's malloc; elsewhere these do nothing).

`return_free_memory` hands freed heap memory back, so that RSS follows what sessions hold. glibc
keeps freed small allocations (a document's text, tokens and embeddings while it is ingested, a
kvcache store's pages) in its arenas; a server's RSS then stays high after the session that
caused it is gone, and operators watching RSS cannot tell that from a leak. `malloc_trim(0)`
returns those pages; it costs well under a millisecond here, and runs only when a document is
committed or dropped and when sessions or caches are deleted.

`keep_freed_memory` keeps freed blocks in the heap between forward passes. By default glibc gives
large blocks back when they are freed: an allocation over its mmap threshold (128 KiB at first,
raised as blocks are freed) is a mapping of its own, and the top of the main heap is trimmed once
128 KiB of it is free. A forward pass over a chunk of 1,024 tokens allocates and frees tensors of
several to tens of MB in every layer; given back, each is faulted in and zeroed by the kernel
again at its next use. Raising both thresholds (blocks up to `MMAP_THRESHOLD` from the heap, no
trimming but `return_free_memory`'s) made the plain forward of Qwen2.5-Coder-1.5B over 1,024
tokens in the main thread 573-583 tok/s instead of 472-496 (bf16, 2 cores); in a second thread,
as the server's compute thread runs, glibc's defaults already reached that (docs/studies/batching-and-cpu-speed.md,
"Keeping freed memory"). The cost: between `return_free_memory` calls the process keeps its
largest pass's transient tensors. `LONGDOC_KEEP_FREED_MEMORY=0`, a preloaded allocator (jemalloc,
tcmalloc) or the operator's own malloc settings (`MALLOC_*_`, `GLIBC_TUNABLES`) leave it alone.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest every glibc accepts on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int
OPERATOR_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def return_free_memory() -> None:
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _glibc_allocates(libc: ctypes.CDLL) -> bool:
    """Whether this process's malloc is glibc's own (not a preloaded or linked-in allocator's) and
    glibc has `mallopt` (musl's libc does not)."""
    if not hasattr(libc, "mallopt"):
        return False
    address = ctypes.c_void_p
    return ctypes.cast(ctypes.CDLL(None).malloc, address).value == ctypes.cast(libc.malloc, address).value


@functools.cache
def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (module docstring), once per process; True if set."""
    libc = _libc()
    if os.environ.get("LONGDOC_KEEP_FREED_MEMORY", "1") == "0" or libc is None or not _glibc_allocates(libc):
        return False
    if any(name in os.environ for name in OPERATOR_SETTINGS) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        log.info("malloc settings in the environment: longdoc leaves glibc's thresholds as they are")
        return False
    # the mmap threshold first: setting either stops glibc raising it by itself, and a trim
    # threshold raised alone leaves every block over 128 KiB a mapping of its own (slower still)
    done = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        log.warning("mallopt refused the mmap or trim threshold; freed memory goes back to the kernel as before")
    return done
