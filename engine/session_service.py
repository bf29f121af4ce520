"""Sessions: made, listed, deleted and cleared; saved to disk after every change, listed from disk at
start and loaded back into RAM on first use. Every byte a session's memory takes is reserved first."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from engine.config import EngineConfig
from engine.embedder import Embedder
from engine.errors import ConflictError, NotFoundError, SnapshotUnreadableError, StorageError
from engine.interface import CacheInfo, SessionInfo
from engine.memories import MEMORIES, Memory, MemoryContext, build_memory, memory_type, saved_kind
from engine.os_memory import return_free_memory
from engine.persistence import Snapshot, SnapshotError, SnapshotStore
from engine.registry import ModelRegistry, ModelRuntime
from engine.sessions import Pin, Session, SessionStore
from engine.worker import SerialWorker

log = logging.getLogger(__name__)

EMBEDDER_WORKER = "embedder"


class SessionService:
    def __init__(self, config: EngineConfig, models: ModelRegistry) -> None:
        self.models = models
        self.snapshots = SnapshotStore(config.data_dir) if config.data_dir is not None else None
        self.store = SessionStore(config.sessions, keep_on_disk=self.snapshots is not None)
        self.store.on_drop = self._delete_files
        self.snapshot_failures = 0  # snapshots found unreadable (logged, skipped, left on disk)
        self.embedder: Embedder | None = None  # set once the models are loaded
        self.embed_worker = SerialWorker(EMBEDDER_WORKER, config.generation.max_queue)

    def memory_context(self, runtime: ModelRuntime) -> MemoryContext:
        return runtime.memory_context(self.embedder)

    def memory_worker(self, session: Session) -> SerialWorker:
        """Memories that run the language model share its worker; the others use the embedder's."""
        return self.models.named(session.model).worker if memory_type(session.kind).runs_on_model else self.embed_worker

    # ---- made, listed, deleted -------------------------------------------------------------

    def create(self, model: str | None, memory: str | None, options: dict[str, Any], owner: str | None) -> SessionInfo:
        """A new session; what its memory allocates up front is reserved against the budgets first."""
        runtime = self.models.runtime(model)
        kind = memory or self.models.default_memory(runtime)
        context = self.memory_context(runtime)
        self.store.check_room()
        with self.store.reserve(None, memory_type(kind).initial_bytes(context, options)):
            memory_obj = build_memory(kind, context, options)
            session = self.store.create(runtime.loaded.name, memory_obj, dict(options), owner)
        try:
            self.save(session)
        except StorageError:
            self.delete(session.id)
            raise
        return session.info()

    def delete(self, session_id: str) -> None:
        self._delete_files(self.store.delete(session_id))
        return_free_memory()

    async def clear(self, session_id: str) -> CacheInfo:
        """Forget every document of the session; runs on the worker that reads the memory."""
        session = self.store.use(session_id)
        if session.write_lock.locked():
            raise ConflictError(f"session {session_id} is ingesting a document or writing an answer; clear it afterwards")
        pin = Pin(session)
        try:
            async with session.write_lock:  # nothing may start writing the memory while it is cleared
                await self.resident(session)
                await self.memory_worker(session).run(self._reset, session)
        finally:
            pin.release()
        return_free_memory()
        return session.cache()

    def _reset(self, session: Session) -> None:
        assert session.memory is not None
        session.memory.reset()
        session.documents.clear()
        self.save(session)

    # ---- on disk ---------------------------------------------------------------------------

    def save(self, session: Session) -> None:
        """Write the session's snapshot (after every change, so eviction and crashes lose nothing
        committed). Runs where the memory is used: its worker thread, or the event loop when the
        session is new. A session whose save failed stays in RAM (dirty) until one succeeds."""
        if self.snapshots is None:
            return
        with session.save_lock:  # a delete waits for a save in progress, and no save follows it
            if session.memory is None or session.deleted:
                return
            try:
                self.snapshots.write(Snapshot(session.metadata(), session.memory.state_dict()))
            except OSError as exc:
                session.dirty = True
                log.error("session %s could not be saved: %s", session.id, exc)
                raise StorageError(f"session {session.id} could not be saved to disk ({exc.strerror or exc})") from exc
            session.dirty = False

    def _delete_files(self, session: Session) -> None:
        if self.snapshots is not None:
            with session.save_lock:
                self.snapshots.delete(session.id)

    def restore(self) -> None:
        """List the sessions saved on disk; each is loaded on its first use."""
        if self.snapshots is None:
            return
        for session_id in self.snapshots.list():
            try:
                session = Session.from_metadata(self.snapshots.read_session(session_id))
                if session.id != session_id:
                    raise SnapshotError(f"the snapshot in folder {session_id} names session {session.id}")
            except (SnapshotError, KeyError, TypeError, ValueError) as exc:
                self._snapshot_failed(session_id, exc)
                continue
            if not self.models.serves(session.model):
                log.warning("session %s on disk uses model %r, which is not served; skipped", session_id, session.model)
                continue
            session.kind = saved_kind(session.kind)
            if session.saved_cache is not None:
                session.saved_cache = dataclasses.replace(session.saved_cache, memory=session.kind)
            if session.kind not in MEMORIES:
                log.warning(
                    "session %s on disk uses memory %r, which no installed code provides; skipped", session_id, session.kind
                )
                continue
            self.store.add(session)
        log.info("%d sessions on disk", len(self.store))

    def _snapshot_failed(self, session_id: str, exc: Exception) -> None:
        self.snapshot_failures += 1
        log.error("session %s: unreadable snapshot, skipped and left on disk: %s", session_id, exc)

    async def resident(self, session: Session) -> None:
        """Load a session saved on disk back into RAM, its bytes reserved first."""
        if session.memory is not None:
            return
        async with session.load_lock:
            if session.memory is not None:
                return
            context = self.memory_context(self.models.named(session.model))
            # what it held when saved (a preallocated cache counts whole there already)
            need = max(memory_type(session.kind).initial_bytes(context, session.options), session.cache().bytes)
            with self.store.reserve(session, need):
                try:
                    session.memory = await self.memory_worker(session).run(self._load_memory, session, context)
                except Exception as exc:
                    if session.deleted:
                        raise NotFoundError(f"no session {session.id!r}") from exc
                    self._snapshot_failed(session.id, exc)
                    raise SnapshotUnreadableError(f"session {session.id} is saved on disk but cannot be read back") from exc

    def _load_memory(self, session: Session, context: MemoryContext) -> Memory:
        assert self.snapshots is not None
        snapshot = self.snapshots.read(session.id)
        memory = build_memory(session.kind, context, session.options)
        memory.load_state_dict(snapshot.state)
        return memory
