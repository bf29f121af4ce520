"""Hand freed heap memory back to the operating system, so that RSS follows what sessions hold.

glibc keeps freed small allocations (a document's text, tokens and embeddings while it is
ingested) in its arenas; a server's RSS then stays high after the session that caused it is gone,
and operators watching RSS cannot tell that from a leak. `malloc_trim(0)` returns those pages; it
costs well under a millisecond here, and runs only when a document is committed or dropped and
when sessions or caches are deleted. A no-op where the C library has no `malloc_trim`.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def return_free_memory() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
