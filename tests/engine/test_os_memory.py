"""engine/runtime/os_memory.py: glibc's thresholds raised, checked in fresh processes (a process's malloc
state is its own history: a block freed earlier raises glibc's mmap threshold by itself)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.runtime import os_memory

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import ctypes
from engine.runtime.os_memory import keep_freed_memory

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = Mallinfo2
kept = keep_freed_memory()
size = 16 << 20  # a layer's transient tensor
mapped, free = libc.mallinfo2().hblkhd, libc.mallinfo2().fordblks
block = libc.malloc(size)
own_mapping = libc.mallinfo2().hblkhd - mapped >= size
libc.free(block)
print(kept, own_mapping, libc.mallinfo2().fordblks - free >= size)
"""


def probe(env: dict[str, str]) -> list[str]:
    run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    return run.stdout.split()


LIBC = os_memory._libc()
needs_glibc = pytest.mark.skipif(LIBC is None or not hasattr(LIBC, "mallopt"), reason="glibc's malloc")


@pytest.mark.skipif(LIBC is None or not hasattr(LIBC, "mallinfo2"), reason="glibc 2.33+ (mallopt, mallinfo2)")
def test_a_freed_block_stays_in_the_heap_only_when_kept():
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    assert probe(env) == ["True", "False", "True"]  # from the heap, and kept there when freed
    assert probe({**env, "LONGDOC_KEEP_FREED_MEMORY": "0"}) == ["False", "True", "False"]  # glibc's own: a mapping
    assert probe({**env, "MALLOC_TRIM_THRESHOLD_": "131072"})[0] == "False"  # the operator's settings win


@needs_glibc
def test_another_allocator_is_left_alone(monkeypatch):
    os_memory.keep_freed_memory.cache_clear()
    monkeypatch.setattr(os_memory, "_glibc_allocates", lambda libc: False)
    try:
        assert os_memory.keep_freed_memory() is False
    finally:
        os_memory.keep_freed_memory.cache_clear()


@needs_glibc
def test_glibc_is_recognised_as_the_allocator():
    assert LIBC is not None and os_memory._glibc_allocates(LIBC)  # pytest runs with glibc's malloc, no allocator preloaded
