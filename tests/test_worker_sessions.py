"""The serial worker's admission and cancellation, and the session store's limits."""

from __future__ import annotations

import threading

import pytest

from engine.config import SessionLimits
from engine.errors import BudgetExceededError, NotFoundError, QueueFullError, SessionLimitError
from engine.memories import MemoryContext, build_memory
from engine.sessions import SessionStore
from engine.worker import EventStream, SerialWorker


async def test_admission_is_bounded_and_slots_come_back():
    worker = SerialWorker("w", max_active=2)
    first, second = worker.admit(), worker.admit()
    with pytest.raises(QueueFullError):
        worker.admit()
    first.release()
    first.release()  # twice is harmless
    assert worker.depth == 1
    third = worker.admit()
    second.release()
    assert worker.depth == 1
    del third  # a slot dropped without release is released when collected
    assert worker.depth == 0


async def test_closing_a_stream_stops_the_generator_and_frees_the_slot():
    worker = SerialWorker("w", max_active=1)
    closed = threading.Event()
    steps_run = []

    def steps():
        try:
            for i in range(1000):
                steps_run.append(i)
                yield i
        finally:
            closed.set()

    stream = EventStream(worker.iterate(steps()), [worker.admit()])
    got = [await stream.__anext__() for _ in range(3)]
    await stream.aclose()
    assert got == [0, 1, 2] and closed.is_set()
    assert len(steps_run) == 3
    assert worker.depth == 0


async def test_steps_run_on_one_thread_off_the_event_loop():
    worker = SerialWorker("w", max_active=4)
    loop_thread = threading.get_ident()

    def steps():
        for _ in range(3):
            yield threading.get_ident()

    threads = {t async for t in worker.iterate(steps())}
    assert len(threads) == 1 and loop_thread not in threads


async def test_error_in_a_step_reaches_the_caller_and_frees_the_slot():
    worker = SerialWorker("w", max_active=1)

    def steps():
        yield 1
        raise ValueError("boom")

    stream = EventStream(worker.iterate(steps()), [worker.admit()])
    with pytest.raises(ValueError, match="boom"):
        async for _ in stream:
            pass
    assert worker.depth == 0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def memory_factory(tiny_tokenizer):
    return lambda: build_memory("truncate", MemoryContext(tokenizer=tiny_tokenizer), {})


def test_idle_sessions_are_evicted_but_busy_ones_stay(memory_factory):
    clock = FakeClock()
    store = SessionStore(SessionLimits(idle_ttl_seconds=60), clock=clock)
    idle, busy, fresh = (store.create("m", memory_factory(), {}) for _ in range(3))
    busy.busy = 1
    clock.now += 50
    store.get(fresh.id)
    clock.now += 20
    assert store.evict_idle() == [idle.id]
    assert {s.id for s in store.list()} == {busy.id, fresh.id}
    with pytest.raises(NotFoundError):
        store.get(idle.id)


def test_session_count_limit(memory_factory):
    store = SessionStore(SessionLimits(max_sessions=2))
    a = store.create("m", memory_factory(), {})
    store.create("m", memory_factory(), {})
    with pytest.raises(SessionLimitError):
        store.create("m", memory_factory(), {})
    store.delete(a.id)
    store.create("m", memory_factory(), {})
    with pytest.raises(NotFoundError):
        store.delete(a.id)


def test_budget_check(memory_factory):
    store = SessionStore(SessionLimits(memory_budget_bytes=1000))
    session = store.create("m", memory_factory(), {})
    store.check_budget(session, 1000)
    with pytest.raises(BudgetExceededError, match="1000-byte budget"):
        store.check_budget(session, 1001)

