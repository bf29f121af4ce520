"""Sessions: made, listed, deleted and cleared; saved to disk after every change, listed from disk at
start and loaded back into RAM on first use. Every byte a session's memory takes is reserved first.

With a shared data folder (replicas of one service, each holding some sessions), a session this
server does not hold is looked up on disk, and one that another server has written since is read
again before use (while nothing here uses it)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig
from engine.errors import ConflictError, NotFoundError, SessionLimitError, SnapshotUnreadableError, StorageError
from engine.interface import CacheInfo, SessionInfo
from engine.memories import MEMORIES, Memory, MemoryContext, build_memory, memory_type, saved_kind
from engine.models.embedder import Embedder
from engine.runtime.os_memory import return_free_memory
from engine.runtime.registry import ModelRegistry, ModelRuntime
from engine.runtime.worker import SerialWorker
from engine.sessions.snapshots import SESSION_ID_CHARS, Snapshot, SnapshotError, SnapshotStore, StaleSnapshotError
from engine.sessions.store import Pin, Session, SessionStore

log = logging.getLogger(__name__)

EMBEDDER_WORKER = "embedder"
MARK_USED_EVERY_SECONDS = 60.0  # with a shared data folder, how often a use is recorded on disk


class SessionService:
    def __init__(self, config: EngineConfig, models: ModelRegistry) -> None:
        if not config.session_id_prefix or not set(config.session_id_prefix) <= SESSION_ID_CHARS:
            raise ValueError(f"session_id_prefix {config.session_id_prefix!r}: use a-z, 0-9 and '-'")
        if config.shared_data_dir and config.data_dir is None:
            raise ValueError("shared_data_dir needs a data_dir")
        self.models = models
        self.snapshots = SnapshotStore(config.data_dir) if config.data_dir is not None else None
        self.shared = config.shared_data_dir
        self.store = SessionStore(config.sessions, keep_on_disk=self.snapshots is not None, id_prefix=config.session_id_prefix)
        self.store.on_drop = self._drop_files
        if self.shared:
            self.store.used_elsewhere = self._used_elsewhere
        self.snapshot_failures = 0  # snapshots found unreadable (logged, skipped, left on disk)
        self._unreadable: dict[str, tuple[int, int, int] | None] = {}  # id: the stamp found unreadable
        self.embedder: Embedder | None = None  # set once the models are loaded
        self.embed_worker = SerialWorker(EMBEDDER_WORKER, config.generation.max_queue)
        self.on_loaded: Callable[[Session], None] = lambda session: None  # a session's memory is in RAM (read or written)

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
        options = {**runtime.manifest_options.get(kind, {}), **options}  # the model's measured defaults, then the request's
        context = self.memory_context(runtime)
        self.store.check_room()
        if self.shared:
            self._check_folder_room()
        with self.store.reserve(None, memory_type(kind).initial_bytes(context, options)):
            memory_obj = build_memory(kind, context, options)
            session = self.store.create(runtime.loaded.name, memory_obj, dict(options), owner)
        try:
            self.save(session)
        except StorageError:
            self.delete(session.id)
            raise
        return session.info()

    def _check_folder_room(self) -> None:
        """With a shared data folder, `max_sessions` is the limit of every server on it together."""
        assert self.snapshots is not None
        limit = self.store.limits.max_sessions
        if len(self.snapshots.list()) >= limit:
            raise SessionLimitError(f"the service holds its limit of {limit} sessions", 30.0)

    def use(self, session_id: str) -> Session:
        """The session, marked used; with a shared data folder, brought up to date with disk first."""
        if self.shared:
            self._sync(session_id)
            session = self.store.use(session_id)
            if session.snapshot_stamp is not None:
                self._mark_used(session)
            return session
        return self.store.use(session_id)

    def list(self) -> list[Session]:
        """Every session held; with a shared data folder, every one on disk, as disk has it."""
        if self.shared:
            assert self.snapshots is not None
            on_disk = set(self.snapshots.list())
            for session_id in on_disk | {s.id for s in self.store.list()}:
                self._sync(session_id)
        return self.store.list()

    def delete(self, session_id: str) -> None:
        if self.shared:
            self._sync(session_id)
        self._delete_files(self.store.delete(session_id))
        return_free_memory()

    async def clear(self, session_id: str) -> CacheInfo:
        """Forget every document of the session; runs on the worker that reads the memory."""
        session = self.use(session_id)
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

    async def document_text(self, session_id: str, document_id: str) -> str:
        """The text a document was ingested as (a PDF's or a web page's extracted text), from a
        memory that keeps it."""
        session = self.use(session_id)
        if not any(document.id == document_id for document in session.documents):
            raise NotFoundError(f"session {session_id} has no document {document_id!r}")
        pin = Pin(session)
        try:
            await self.resident(session)
            assert session.memory is not None
            text = session.memory.document_text(document_id)
        finally:
            pin.release()
        if text is None:
            raise NotFoundError(f"the {session.kind} memory does not keep its documents' text (the text memory does)")
        return text

    def _reset(self, session: Session) -> None:
        assert session.memory is not None
        session.memory.reset()
        session.documents.clear()
        self.save(session)

    # ---- on disk ---------------------------------------------------------------------------

    def save(self, session: Session) -> None:
        """Write the session's snapshot (after every change, so eviction and crashes lose nothing
        committed). Runs where the memory is used: its worker thread, or the event loop when the
        session is new. A session whose save failed stays in RAM (dirty) until one succeeds. A
        session another server wrote or deleted since this one read it is not saved (ConflictError):
        what RAM holds is read again from disk once nothing here uses it."""
        if self.snapshots is None:
            return
        with session.save_lock:  # a delete waits for a save in progress, and no save follows it
            if session.memory is None or session.deleted:
                return
            snapshot = Snapshot(session.metadata(), session.memory.state_dict())
            try:
                session.snapshot_generation = self.snapshots.write(snapshot, expected=session.snapshot_generation)
                session.snapshot_stamp = self.snapshots.stamp(session.id)
            except StaleSnapshotError as exc:
                log.warning("session %s: not saved, another server changed it first: %s", session.id, exc)
                session.dirty = False  # what RAM holds is not to be saved: disk has the newer session
                session.snapshot_stamp = None  # so it is read again once nothing here uses it
                raise ConflictError(
                    f"session {session.id} was changed by another replica while this request ran; "
                    "this change was not saved: send it again"
                ) from exc
            except OSError as exc:
                session.dirty = True
                log.error("session %s could not be saved: %s", session.id, exc)
                raise StorageError(f"session {session.id} could not be saved to disk ({exc.strerror or exc})") from exc
            session.dirty = False

    def _delete_files(self, session: Session, expected: int | None = None) -> None:
        if self.snapshots is not None:
            with session.save_lock:
                self.snapshots.delete(session.id, expected)

    def _drop_files(self, session: Session) -> None:
        """A session dropped for age: its files go unless another server has written it since."""
        self._delete_files(session, expected=session.snapshot_generation)

    def restore(self) -> None:
        """List the sessions saved on disk; each is loaded on its first use."""
        if self.snapshots is None:
            return
        for session_id in self.snapshots.list():
            self._add_from_disk(session_id)
        log.info("%d sessions on disk", len(self.store))

    def _add_from_disk(self, session_id: str) -> None:
        """Hold a session saved on disk (not resident), unless it cannot be served here."""
        assert self.snapshots is not None
        stamp = self.snapshots.stamp(session_id)  # before reading: a write in between is seen next time
        try:
            metadata, generation = self.snapshots.read_session(session_id)
            session = Session.from_metadata(metadata)
            if session.id != session_id:
                raise SnapshotError(f"the snapshot in folder {session_id} names session {session.id}")
        except (SnapshotError, KeyError, TypeError, ValueError) as exc:
            self._unreadable[session_id] = stamp  # counted once, until it changes
            self._snapshot_failed(session_id, exc)
            return
        if not self.models.serves(session.model):
            log.warning("session %s on disk uses model %r, which is not served; skipped", session_id, session.model)
            return
        session.kind = saved_kind(session.kind)
        if session.saved_cache is not None:
            session.saved_cache = dataclasses.replace(session.saved_cache, memory=session.kind)
        if session.kind not in MEMORIES:
            log.warning("session %s on disk uses memory %r, which no installed code provides; skipped", session_id, session.kind)
            return
        session.snapshot_stamp = stamp
        session.snapshot_generation = generation
        self.store.add(session)

    def _sync(self, session_id: str) -> None:
        """Bring what this server holds of a session up to date with a shared data folder: read a
        session it does not hold, read again one another server has written since, forget one
        another server deleted. A session this server is using is left as it is."""
        assert self.snapshots is not None
        stamp = self.snapshots.stamp(session_id)
        held = self.store.peek(session_id)
        if held is None:
            if session_id in self._unreadable and self._unreadable[session_id] == stamp:
                return  # counted already
        elif held.snapshot_stamp == stamp or self._in_use(held):
            return
        else:
            self.store.delete(session_id)  # its files stay: they are newer, or gone already
        if stamp is not None:
            self._add_from_disk(session_id)

    @staticmethod
    def _in_use(session: Session) -> bool:
        busy = session.requests_in_flight or session.reserved or session.dirty
        return bool(busy or session.write_lock.locked() or session.load_lock.locked())

    def _mark_used(self, session: Session) -> None:
        assert self.snapshots is not None
        now = time.time()
        if now - session.marked_used_at >= MARK_USED_EVERY_SECONDS:
            session.marked_used_at = now
            self.snapshots.mark_used(session.id)

    def _used_elsewhere(self, session: Session) -> bool:
        """A session on disk that another server wrote or used within the TTL is not dropped here."""
        assert self.snapshots is not None
        last = self.snapshots.last_activity(session.id)
        if last > session.last_used_at:
            session.last_used_at = last
        return last >= time.time() - self.store.limits.saved_ttl_seconds

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
                    if session.memory.remade_on_load:
                        await self.memory_worker(session).run(self._save_remade, session)
                except Exception as exc:
                    if session.deleted:
                        raise NotFoundError(f"no session {session.id!r}") from exc
                    self._snapshot_failed(session.id, exc)
                    raise SnapshotUnreadableError(f"session {session.id} is saved on disk but cannot be read back") from exc
            self.on_loaded(session)

    def _save_remade(self, session: Session) -> None:
        """Save a session whose memory made part of its state again while loading; a failure
        leaves it in RAM as loaded (the next load makes it again)."""
        try:
            self.save(session)
        except (ConflictError, StorageError) as exc:
            log.warning("session %s: remade on load but not saved: %s", session.id, exc)

    def _load_memory(self, session: Session, context: MemoryContext) -> Memory:
        assert self.snapshots is not None
        snapshot = self.snapshots.read(session.id)
        options = memory_type(session.kind).saved_options(session.options, snapshot.state)
        memory = build_memory(session.kind, context, options)
        memory.load_state_dict(snapshot.state)
        if snapshot.generation != session.snapshot_generation:  # written since it was listed
            session.documents = Session.from_metadata(snapshot.session).documents
            session.snapshot_generation = snapshot.generation
        return memory
