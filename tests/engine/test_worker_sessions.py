"""The serial worker's admission and cancellation, and the session store's limits."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import subprocess
import sys
import threading

import pytest

from engine.config import SessionLimits
from engine.errors import BudgetExceededError, NotFoundError, QueueFullError, SessionLimitError, TooLargeError
from engine.memories import MemoryContext, build_memory
from engine.runtime.worker import EventStream, SerialWorker, on_compute_thread
from engine.sessions.store import SessionStore


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


async def test_steps_of_every_worker_run_on_one_thread_off_the_event_loop():
    model, embedder = SerialWorker("model", max_active=4), SerialWorker("embedder", max_active=4)
    loop_thread = threading.get_ident()

    def steps():
        for _ in range(3):
            yield threading.get_ident()

    threads = {t async for t in model.iterate(steps())} | {t async for t in embedder.iterate(steps())}
    assert len(threads) == 1 and loop_thread not in threads
    assert await on_compute_thread(threading.get_ident) in threads


async def test_a_stopped_worker_refuses_calls_and_drops_its_queued_ones_only():
    stopping, going_on = SerialWorker("stopping", max_active=4), SerialWorker("going on", max_active=4)
    release, started = threading.Event(), threading.Event()

    def running() -> str:
        started.set()
        release.wait(10)
        return "finished"

    in_flight = asyncio.ensure_future(stopping.run(running))
    await asyncio.sleep(0)
    assert await asyncio.to_thread(started.wait, 10)
    queued = asyncio.ensure_future(stopping.run(lambda: "ran"))
    queued_elsewhere = asyncio.ensure_future(going_on.run(lambda: "other worker"))
    await asyncio.sleep(0.05)  # both queued behind the running call
    stopping.shutdown()
    release.set()
    assert await in_flight == "finished"  # a call already running is not cut short
    with pytest.raises(asyncio.CancelledError):
        await queued
    assert await queued_elsewhere == "other worker"
    with pytest.raises(RuntimeError, match="stopped"):
        await stopping.run(lambda: "late")
    assert await going_on.run(lambda: "still serving") == "still serving"


TEAM_CHECK = """
import os, threading, time, torch
from engine.runtime.worker import single_threaded_torch
torch.set_num_threads(2)  # as a Ray replica does on its event loop's thread
a = torch.randn(1024, 1024)
expected = a @ a
def tasks():
    return len(os.listdir("/proc/self/task"))
def work(guarded, out):
    if guarded:
        single_threaded_torch()
    before = tasks()
    got = a @ a + torch.zeros(4_000_000).sum()  # MKL, and an ATen parallel_for, each big enough to go parallel
    out.extend([tasks() - before, torch.get_num_threads(), bool(torch.allclose(got, expected, atol=1e-2))])
baseline = tasks()
for guarded in (False, True):
    out = []
    thread = threading.Thread(target=work, args=(guarded, out))
    thread.start()
    thread.join()
    deadline = time.monotonic() + 10
    while tasks() > baseline and time.monotonic() < deadline:  # the OS thread and its team end after join
        time.sleep(0.01)
    print(guarded, *out)
"""


async def test_a_stream_dropped_while_its_step_runs_still_closes_on_the_compute_thread_after_shutdown():
    worker = SerialWorker("w", max_active=1)
    release, running = threading.Event(), threading.Event()
    closed_on: list[int] = []

    def steps():
        try:
            yield 0
            running.set()
            release.wait(10)
            yield 1
        finally:
            closed_on.append(threading.get_ident())

    stream = worker.iterate(steps())
    assert await stream.__anext__() == 0
    pending = asyncio.ensure_future(stream.__anext__())
    assert await asyncio.to_thread(running.wait, 10)
    pending.cancel()  # the client goes while its step runs: close waits behind the step
    closing = asyncio.ensure_future(stream.aclose())
    await asyncio.sleep(0.05)
    worker.shutdown()
    release.set()
    with contextlib.suppress(asyncio.CancelledError, RuntimeError):
        await pending
    with contextlib.suppress(asyncio.CancelledError, RuntimeError):
        await closing
    assert closed_on == [await on_compute_thread(threading.get_ident)]


def test_a_single_threaded_thread_starts_no_openmp_team_and_computes_the_same():
    """In a fresh process (no other threads coming or going): a thread's torch work starts OpenMP
    threads, unless the thread was made single-threaded first."""
    lines = subprocess.run([sys.executable, "-c", TEAM_CHECK], capture_output=True, text=True, check=True).stdout.split("\n")
    unguarded, guarded = (line.split() for line in lines[:2])
    assert unguarded[0] == "False" and int(unguarded[1]) > 0 and unguarded[2] == "2" and unguarded[3] == "True"
    assert guarded == ["True", "0", "1", "True"]


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
    busy.requests_in_flight = 1
    clock.now += 50
    store.use(fresh.id)
    clock.now += 20
    assert [s.id for s in store.evict_idle()] == [idle.id]
    assert {s.id for s in store.list()} == {busy.id, fresh.id}
    with pytest.raises(NotFoundError):
        store.use(idle.id)


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


def test_session_budget_refuses_with_413_when_it_can_never_fit_else_429(memory_factory):
    store = SessionStore(SessionLimits(memory_budget_bytes=1000, server_memory_bytes=10_000))
    session = store.create("m", memory_factory(), {})
    with pytest.raises(TooLargeError, match="a session may hold 1000"):
        store.reserve(session, 1001)
    held = store.reserve(session, 600)
    with pytest.raises(BudgetExceededError, match="400 of its 1000-byte budget are left") as refused:
        store.reserve(session, 500)
    assert refused.value.retry_after > 0
    held.release()
    held.release()  # harmless twice
    store.reserve(session, 1000).release()
    assert store.reserved_bytes == 0 and session.reserved == 0


def test_server_budget_counts_every_session_and_reservation(memory_factory):
    store = SessionStore(SessionLimits(memory_budget_bytes=1000, server_memory_bytes=2500))
    a, b, c = (store.create("m", memory_factory(), {}) for _ in range(3))
    first, second = store.reserve(a, 1000), store.reserve(b, 1000)
    assert store.used_bytes() == 2000
    with pytest.raises(BudgetExceededError, match="server's session memory is full"):
        store.reserve(c, 600)
    with pytest.raises(BudgetExceededError):
        store.reserve(None, 600)  # a session being made counts the same
    second.release()
    store.reserve(c, 600).release()
    with pytest.raises(TooLargeError, match="LONGDOC_MAX_MEMORY_BYTES"):
        SessionStore(SessionLimits(memory_budget_bytes=5000, server_memory_bytes=2500)).reserve(None, 3000)
    first.release()


def test_reservation_grows_under_the_same_budgets_and_frees_when_dropped(memory_factory):
    store = SessionStore(SessionLimits(memory_budget_bytes=1000, server_memory_bytes=10_000))
    session = store.create("m", memory_factory(), {})
    reservation = store.reserve(session, 100)
    reservation.grow_to(50)  # never shrinks below what was promised
    reservation.grow_to(900)
    assert store.reserved_bytes == 900
    with pytest.raises(BudgetExceededError):
        reservation.grow_to(1001)
    assert store.reserved_bytes == 900
    del reservation
    gc.collect()
    assert store.reserved_bytes == 0 and session.reserved == 0


def test_deleted_and_evicted_sessions_are_marked(memory_factory):
    clock = FakeClock()
    store = SessionStore(SessionLimits(idle_ttl_seconds=60), clock=clock)
    deleted, idle = store.create("m", memory_factory(), {}), store.create("m", memory_factory(), {})
    store.delete(deleted.id)
    clock.now += 61
    store.evict_idle()
    assert deleted.deleted and idle.deleted
