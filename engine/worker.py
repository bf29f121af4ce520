"""A serial worker: one thread owns a model, so forward passes never race.

Requests are admitted up to `max_active` (running or waiting) and refused beyond it. Streaming work
is a plain generator driven one step at a time on the worker thread, so concurrent requests
interleave step by step and a closed stream stops after the step in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, Protocol, TypeVar

from engine.errors import QueueFullError

T = TypeVar("T")
_DONE = object()


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
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"longdoc-{name}")

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
        """Run one blocking call on the worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

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
            if close is not None:  # after the step in flight, on the same thread
                await asyncio.shield(self.run(close))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


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
