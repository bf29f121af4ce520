import ctypes
import ctypes.util
import platform

import pytest

from engine import allocator

GLIBC = platform.libc_ver()[0] == "glibc"


@pytest.fixture(autouse=True)
def fresh():
    allocator.keep_freed_memory.cache_clear()
    yield
    allocator.keep_freed_memory.cache_clear()


class Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt and mallinfo2")
def test_freed_blocks_stay_in_the_heap():
    assert allocator.keep_freed_memory() is True
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = Mallinfo2
    size = 16 << 20  # a layer's transient tensor; glibc's default maps it on its own and unmaps it when freed
    mapped_before = libc.mallinfo2().hblkhd
    block = libc.malloc(size)
    assert libc.mallinfo2().hblkhd - mapped_before < size  # from the heap, not a mapping
    libc.free(block)
    assert libc.mallinfo2().fordblks >= size  # and kept there, free for the next pass


def test_off_by_environment(monkeypatch):
    monkeypatch.setenv("LONGDOC_KEEP_FREED_MEMORY", "0")
    assert allocator.keep_freed_memory() is False


def test_leaves_a_preloaded_allocator(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert allocator.keep_freed_memory() is False
