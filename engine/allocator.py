"""Keep freed memory in the process for reuse (glibc's malloc), for inference on the CPU.

By default glibc gives large blocks back to the kernel when they are freed: an allocation over
its mmap threshold (128 KiB at first, raised as blocks are freed) is a mapping of its own, and
the top of the heap is trimmed once 128 KiB of it is free. A forward pass over a chunk of 1,024
tokens allocates and frees tensors of several to tens of MB in every layer; given back, each is
faulted in and zeroed by the kernel again at its next use. `keep_freed_memory` raises both
thresholds, so blocks up to `MMAP_THRESHOLD` come from the heap and freed ones stay there for the
next pass. Bigger blocks (a session's key/value store) keep their own mappings and go back to the
kernel when freed. The cost: the process keeps its peak heap (the largest pass's transient
tensors) instead of returning it between passes.

Measured (docs/benchmarks.md, "Keeping freed memory"): the plain forward of 1,024 tokens of
Qwen2.5-Coder-1.5B in bf16 on 2 cores went from 472-496 to 575-583 tok/s.

`LONGDOC_KEEP_FREED_MEMORY=0` leaves malloc as it is. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest every glibc accepts (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 2**31 - 1  # an int: mallopt takes one


@functools.cache
def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (module docstring), once per process; True if set."""
    if os.environ.get("LONGDOC_KEEP_FREED_MEMORY", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if mallopt is None or "malloc" in os.environ.get("LD_PRELOAD", ""):
        return False  # not glibc, or another allocator (jemalloc, tcmalloc) preloaded
    # the mmap threshold first: setting either turns off glibc's own raising of it
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        log.warning("mallopt refused the mmap or trim threshold; freed memory goes back to the kernel")
    return done
