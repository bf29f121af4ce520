"""Serial workers on one compute thread: forward passes never race, and one thread does the
server's torch work.

Requests are admitted up to `max_active` (running or waiting) and refused beyond it. Streaming work
is a plain generator driven one step at a time on the compute thread, so concurrent requests
interleave step by step and a closed stream stops after the step in flight.

Every worker (each model's, the embedder's) and model loading run on the same thread. On CPU,
torch's OpenMP kernels are fast only while one thread's team owns the cores: once a second
thread starts a team, libgomp sees more threads than cores and stops spinning between parallel
regions, and each of a decode step's ~210 matmuls pays a wake-up (docs/studies/quantize.md, "One
compute thread"). Other threads that may touch torch (the event loop, its `asyncio.to_thread`
helpers) are made single-threaded with `single_threaded_torch` (OpenMP's and MKL's per-thread
counts), so they start no team of torch's own. FAISS has its own OpenMP runtime, outside this.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
from collections.abc import AsyncGenerator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch

from engine.errors import QueueFullError

T = TypeVar("T")
_DONE = object()
log = logging.getLogger(__name__)


@functools.cache
def compute_executor() -> ThreadPoolExecutor:
    """The one thread every worker runs on (made on first use, kept for the process's life)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="longdoc-compute")


async def on_compute_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run one blocking call on the compute thread."""
    return await asyncio.wrap_future(compute_executor().submit(fn, *args))


def _loaded_libraries(name: str) -> list[Path]:
    """Shared libraries of this process whose file name starts with `name`."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    paths = {line.split(maxsplit=5)[-1] for line in maps.splitlines() if "/" in line}
    return sorted(Path(p) for p in paths if Path(p).name.startswith(name))


@functools.cache
def _per_thread_setters() -> tuple[Callable[[int], object], ...]:
    """Per-thread thread-count setters of torch's own OpenMP runtime and of the MKL inside it."""
    torch_dir = str(Path(torch.__file__).resolve().parent)  # its libraries are in torch/lib or torch.libs
    setters = []
    if "OpenMP" in torch.__config__.parallel_info():
        ours = [p for p in _loaded_libraries("libgomp") if str(p).startswith((torch_dir + "/", torch_dir + ".libs/"))]
        if ours:
            setters.append(ctypes.CDLL(str(ours[0])).omp_set_num_threads)
        else:
            log.warning("torch's OpenMP runtime was not found; other threads' torch calls may slow the compute thread")
    for library in _loaded_libraries("libtorch_cpu"):
        mkl_local = getattr(
            ctypes.CDLL(str(library)), "MKL_Set_Num_Threads_Local", None
        )  # the C entry (the lower-case one is Fortran's, by reference)
        if mkl_local is not None:
            setters.append(mkl_local)
    return tuple(setters)


def set_compute_threads(count: int) -> None:
    """Torch's intra-op threads for this process, at least one (a Ray replica: the CPUs Ray reserved for it)."""
    torch.set_num_threads(max(1, count))


def single_threaded_torch() -> None:
    """Make torch run single-threaded on the calling thread only, so it starts no OpenMP team.

    `torch.set_num_threads` is process-wide; OpenMP's thread count is per thread, and torch reads it
    (after its own per-thread setup, which `torch.get_num_threads` triggers) before each parallel
    region; MKL has its own per-thread count, which torch may have set too."""
    torch.get_num_threads()
    for setter in _per_thread_setters():
        setter(1)


class Slot:
    """One admitted request; releasing it twice is harmless."""

    def __init__(self, worker: SerialWorker) -> None:
        self._worker = worker
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._worker._active -= 1

    def __del__(self) -> None:  # a stream dropped without being iterated must not leak its slot
        self.release()


class SerialWorker:
    def __init__(self, name: str, max_active: int) -> None:
        self.name = name
        self.max_active = max_active
        self._active = 0
        self._executor = compute_executor()  # shared: see the module's docstring
        self._pending: set[Future[Any]] = set()
        self._stopped = False

    @property
    def depth(self) -> int:
        """Admitted requests, running or waiting."""
        return self._active

    def admit(self) -> Slot:
        if self._active >= self.max_active:
            raise QueueFullError(f"worker {self.name!r} has {self._active} requests in flight; try again shortly")
        self._active += 1
        return Slot(self)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run one blocking call on the compute thread, after the calls queued before it."""
        return await self.start(fn, *args)

    def start(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Queue one blocking call for the compute thread now (it may start before the caller next
        awaits); its result, to await on the event loop."""
        if self._stopped:
            raise RuntimeError(f"worker {self.name!r} has stopped")
        return self._queue(fn, *args)

    def _queue(self, fn: Callable[..., T], *args: Any, cancellable: bool = True) -> asyncio.Future[T]:
        job = self._executor.submit(fn, *args)
        if cancellable:  # `shutdown` may drop it while it waits
            self._pending.add(job)
            job.add_done_callback(self._pending.discard)
        return asyncio.wrap_future(job)

    async def iterate(self, steps: Iterator[T]) -> AsyncGenerator[T, None]:
        """Drive a blocking generator step by step on the worker thread; closing stops it."""
        try:
            while True:
                item = await self.run(next, steps, _DONE)
                if item is _DONE:
                    return
                yield item
        finally:
            close = getattr(steps, "close", None)
            if close is not None:  # after the step in flight, on the same thread, also once stopped
                await asyncio.shield(self._queue(close, cancellable=False))

    def shutdown(self) -> None:
        """Refuse new calls and cancel this worker's queued ones; a call already running finishes
        (the compute thread goes on for other workers)."""
        self._stopped = True
        for job in list(self._pending):
            job.cancel()


class Releasable(Protocol):
    def release(self) -> None: ...


@contextlib.contextmanager
def released_on_error(held: list[Releasable]) -> Iterator[list[Releasable]]:
    """Release what a request holds (slots, reservations, pins) if it fails before it streams."""
    try:
        yield held
    except BaseException:
        for item in held:
            item.release()
        raise


class EventStream(Generic[T]):
    """An async iterator over a started request that releases its slots (and memory
    reservations) however it ends, also when it is dropped before its first event.
    It is what `engine.interface.EventIterator` describes."""

    def __init__(self, events: AsyncGenerator[T, None], slots: list[Releasable]) -> None:
        self._events = events
        self._slots = slots

    def __aiter__(self) -> EventStream[T]:
        return self

    async def __anext__(self) -> T:
        try:
            return await self._events.__anext__()
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            for slot in self._slots:
                slot.release()
