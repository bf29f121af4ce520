"""Background summaries: the served model writes what a session's memory asks for
(`Memory.summary_tasks`; the text memory's summary trees with `summarize`), a few at a time, queued
behind the answers, and each is kept and saved as it is written.

A session's build starts when a document is ingested and when the session is loaded back into RAM
(after a restart it goes on where the saved summaries end), holds the session in RAM while it runs,
and stops when the session is deleted, when the memory has nothing left to write, or on an error
(shown in the session's cache info; its next load or document starts it again). What a summary's
answer holds of the server's memory is counted as any answer's (the batcher's blocks, or a
reservation), and what the memory keeps of it is reserved from the session's budget first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from engine.answering import generate_events
from engine.errors import LongdocError
from engine.interface import GenerationParams, TokenDelta
from engine.memories.base import SummaryTask
from engine.prompts import render
from engine.sessions.service import SessionService
from engine.sessions.store import Pin, Session

log = logging.getLogger(__name__)
BACKGROUND_ROWS = 2  # summaries written at once, over all sessions: one's prompt is fed while the other decodes
# a summary names its people again and again: the answers' 4-token guard would bend the names
# ("Rosalind", then "Rosalinda"); this one still stops loops
SUMMARY_NO_REPEAT_NGRAM = 12


class Summarizer:
    def __init__(self, session_service: SessionService) -> None:
        self.session_service = session_service
        self._builds: dict[str, asyncio.Task[None]] = {}
        self._rows: asyncio.Semaphore | None = None  # made on the event loop, on first use
        self._more: set[str] = set()  # sessions whose running build may have missed new work

    def ensure(self, session: Session) -> None:
        """Start the session's build unless it runs or its memory has nothing to write."""
        memory = session.memory
        if memory is None or session.deleted or not memory.writes_summaries:
            return
        build = self._builds.get(session.id)
        if build is not None and not build.done():
            self._more.add(session.id)  # it asks again before it ends
            return
        memory.summary_error = None
        self._builds[session.id] = asyncio.get_running_loop().create_task(self._build(session))

    def cancel(self, session_id: str) -> None:
        self._more.discard(session_id)
        build = self._builds.pop(session_id, None)
        if build is not None:
            build.cancel()

    async def stop(self) -> None:
        builds = list(self._builds.values())
        self._builds.clear()
        for build in builds:
            build.cancel()
        for build in builds:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await build

    async def _build(self, session: Session) -> None:
        """Ask the memory for work, write up to BACKGROUND_ROWS summaries at once, until none is left."""
        pin = Pin(session)  # resident until the build ends
        memory = session.memory
        assert memory is not None
        worker = self.session_service.memory_worker(session)
        running: dict[object, asyncio.Task[None]] = {}
        started, written = time.perf_counter(), 0
        try:
            while not session.deleted:
                busy = frozenset(running)
                for task in await worker.run(memory.summary_tasks, BACKGROUND_ROWS - len(running), busy):
                    running[task.key] = asyncio.create_task(self._write(session, task))
                if not running and session.id in self._more:
                    self._more.discard(session.id)
                    continue
                if not running:
                    break
                done, _ = await asyncio.wait(list(running.values()), return_when=asyncio.FIRST_COMPLETED)
                for key in [key for key, job in running.items() if job in done]:
                    running.pop(key).result()  # an error stops the build
                    written += 1
            log.info("session %s: %d summaries written in %.1f s", session.id, written, time.perf_counter() - started)
        except LongdocError as exc:
            memory.summary_error = str(exc)
            log.warning("session %s: summaries stopped: %s", session.id, exc)
        except Exception:
            memory.summary_error = "an internal error (logged)"
            log.exception("session %s: summaries stopped", session.id)
        finally:
            for job in running.values():
                job.cancel()
            pin.release()

    async def _write(self, session: Session, task: SummaryTask) -> None:
        """One summary: its bytes reserved, the model's answer, then kept and saved under the
        session's write lock (no ingestion or clearing half-way)."""
        memory = session.memory
        assert memory is not None
        store = self.session_service.store
        runtime = self.session_service.models.named(session.model)
        with store.reserve(session, memory.summary_bytes(task)):
            prompt_ids = await asyncio.to_thread(render, runtime.loaded.tokenizer, task.messages)
            params = GenerationParams(max_tokens=task.max_tokens, temperature=0.0, no_repeat_ngram_size=SUMMARY_NO_REPEAT_NGRAM)
            # without the batcher's blocks, the answer's keys and values are reserved here
            kv = 0 if runtime.batcher is not None else (len(prompt_ids) + task.max_tokens) * runtime.loaded.kv_bytes_per_token
            if self._rows is None:
                self._rows = asyncio.Semaphore(BACKGROUND_ROWS)
            async with self._rows, contextlib.aclosing(generate_events(runtime, prompt_ids, params, background=True)) as answer:
                with store.reserve(None, kv, transient=True):
                    pieces = [event.text async for event in answer if isinstance(event, TokenDelta)]
            async with session.write_lock:
                await self.session_service.memory_worker(session).run(self._keep, session, task, "".join(pieces))

    def _keep(self, session: Session, task: SummaryTask, text: str) -> None:
        """On the memory's worker: the summary into the memory, and the session saved."""
        assert session.memory is not None
        if not session.deleted and session.memory.add_summary(task, text):
            self.session_service.save(session)
