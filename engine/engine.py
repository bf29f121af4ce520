"""The engine: loaded models, their workers, and sessions, behind `engine.interface.EngineClient`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.batching import BatchDecoder, Batcher
from engine.config import EngineConfig
from engine.embedder import Embedder
from engine.errors import (
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    NotReadyError,
    SnapshotUnreadableError,
    StorageError,
    TooLargeError,
)
from engine.generation import StopTokens, generate_steps
from engine.ingest import ingest_steps, tokenize_document
from engine.interface import (
    MAX_TEMPERATURE,
    SEED_RANGE,
    CacheInfo,
    DocumentInfo,
    EngineStats,
    GenerationEvent,
    GenerationParams,
    IngestEvent,
    ModelInfo,
    SessionInfo,
)
from engine.memories import MEMORIES, ContextPiece, Memory, MemoryContext, build_memory, memory_type
from engine.memories.base import AnswerRequest, MemoryWrite
from engine.models.loader import LoadedModel, load_model, resolve_device, resolve_dtype
from engine.models.manifest import FALLBACK_MEMORY, default_memory_of
from engine.models.neurocache import Neurocache
from engine.models.neurocache_io import load_adapter
from engine.os_memory import return_free_memory
from engine.persistence import Snapshot, SnapshotError, SnapshotStore
from engine.prompts import Messages, overhead_tokens, render
from engine.sessions import Pin, Reservation, Session, SessionStore
from engine.worker import EventStream, Releasable, SerialWorker, released_on_error

log = logging.getLogger(__name__)

EMBEDDER_WORKER = "embedder"


@dataclass
class ModelRuntime:
    loaded: LoadedModel
    worker: SerialWorker
    stop_tokens: StopTokens
    neurocache: Neurocache | None = None
    batcher: Batcher | None = None  # None: the model's answers are decoded one request at a time

    @functools.cached_property
    def manifest_memory(self) -> str:
        """The default memory the model's manifest names (read once)."""
        return default_memory_of(self.loaded.name, self.loaded.source)

    def memory_context(self, embedder: Embedder | None) -> MemoryContext:
        loaded = self.loaded
        return MemoryContext(
            tokenizer=loaded.tokenizer,
            embedder=embedder,
            neurocache=self.neurocache,
            stream_model=loaded.model if loaded.streaming else None,
            model=None if loaded.streaming else loaded.model,
            context_len=loaded.context_len,
        )

    @functools.cached_property
    def memories(self) -> tuple[str, ...]:
        """The memories a session on this model can use."""
        context = self.memory_context(None)
        return tuple(kind for kind, memory in MEMORIES.items() if memory.available(context))

    def info(self) -> ModelInfo:
        return ModelInfo(
            name=self.loaded.name,
            source=self.loaded.source,
            architecture=self.loaded.architecture,
            context_len=self.loaded.context_len,
            device=str(self.loaded.device),
            dtype=str(self.loaded.dtype).removeprefix("torch."),
            memories=self.memories,
        )


class Engine:
    """Owns every model and session. Blocking work runs on the workers, never on the event loop."""

    def __init__(self, config: EngineConfig, *, embedder_factory: Callable[[], Embedder] | None = None) -> None:
        self.config = config
        self.snapshots = SnapshotStore(config.data_dir) if config.data_dir is not None else None
        self.sessions = SessionStore(config.sessions, keep_on_disk=self.snapshots is not None)
        self.sessions.on_drop = self._delete_files
        self.snapshot_failures = 0  # snapshots found unreadable (logged, skipped, left on disk)
        self._models: dict[str, ModelRuntime] = {}
        self._embedder_factory = embedder_factory or self._default_embedder
        self._embedder: Embedder | None = None
        self._embed_worker = SerialWorker(EMBEDDER_WORKER, config.generation.max_queue)
        self._reaper: asyncio.Task[None] | None = None
        self._ready = False

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready

    def _default_embedder(self) -> Embedder:
        device = resolve_device(self.config.models.device)
        return Embedder(device=device, dtype=resolve_dtype(self.config.models.dtype, device))

    def _load_all(self) -> None:
        spec = self.config.models
        for source in spec.sources:
            loaded = load_model(source, cache_dir=spec.cache_dir, device=spec.device, dtype=spec.dtype)
            if loaded.name in self._models:
                raise ValueError(f"two models are named {loaded.name!r}; serve each folder once")
            worker = SerialWorker(f"model:{loaded.name}", self.config.generation.max_queue)
            neurocache = None if loaded.streaming else self._find_adapter(loaded)
            stop = StopTokens.of(loaded.model, loaded.tokenizer)
            batcher = self._batcher(loaded, worker, stop)
            self._models[loaded.name] = ModelRuntime(loaded, worker, stop, neurocache, batcher)
            log.info("loaded model %s (%s, %s on %s)", loaded.name, loaded.architecture, loaded.dtype, loaded.device)
        self._embedder = self._embedder_factory()

    def _batcher(self, loaded: LoadedModel, worker: SerialWorker, stop: StopTokens) -> Batcher | None:
        if self.config.generation.max_batch == 1 or loaded.streaming or not BatchDecoder.supports(loaded.model):
            return None
        limits = self.config.generation
        return Batcher(BatchDecoder(loaded.model, limits.batch_invariant), worker, loaded.tokenizer, stop, limits.max_batch)

    def _find_adapter(self, loaded: LoadedModel) -> Neurocache | None:
        """The first Neurocache adapter named after the model in the adapter folders, if any."""
        for folder in self.config.models.adapter_dirs:
            candidate = Path(folder).expanduser() / loaded.name
            if (candidate / "adapter.json").is_file():
                neurocache = load_adapter(loaded.model, loaded.tokenizer, candidate)
                log.info("model %s: Neurocache adapter from %s", loaded.name, candidate)
                return neurocache
        return None

    async def start(self) -> None:
        """Load models off the event loop, then start evicting idle sessions."""
        await asyncio.to_thread(self._load_all)
        await asyncio.to_thread(self._restore_sessions)
        self._ready = True
        self._reaper = asyncio.create_task(self._reap_idle_sessions())

    async def stop(self) -> None:
        self._ready = False
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for runtime in self._models.values():
            runtime.worker.shutdown()
        self._embed_worker.shutdown()

    async def _reap_idle_sessions(self) -> None:
        period = min(30.0, self.config.sessions.idle_ttl_seconds / 4)
        while True:
            await asyncio.sleep(period)
            self.sessions.evict_idle()
            return_free_memory()

    def _require_ready(self) -> None:
        if not self._ready:
            raise NotReadyError("the server is still loading its models")

    def _runtime(self, model: str | None) -> ModelRuntime:
        self._require_ready()
        name = model or next(iter(self._models))
        if name not in self._models:
            raise NotFoundError(f"no model {name!r}; loaded: {sorted(self._models)}")
        return self._models[name]

    # ---- models and sessions ---------------------------------------------------------------

    def tokenizer(self, model: str | None = None) -> Any:
        """The tokenizer of a loaded model (the first by default)."""
        return self._runtime(model).loaded.tokenizer

    def list_models(self) -> list[ModelInfo]:
        return [runtime.info() for runtime in self._models.values()]

    def create_session(
        self, model: str | None, memory: str | None, options: dict[str, Any], owner: str | None = None
    ) -> SessionInfo:
        """A new session; what its memory allocates up front is reserved against the budgets first."""
        runtime = self._runtime(model)
        kind = memory or self._default_memory(runtime)
        context = self._memory_context(runtime)
        self.sessions.check_room()
        with self.sessions.reserve(None, memory_type(kind).initial_bytes(context, options)):
            memory_obj = build_memory(kind, context, options)
            session = self.sessions.create(runtime.loaded.name, memory_obj, dict(options), owner)
        try:
            self._save(session)
        except StorageError:
            self.delete_session(session.id)
            raise
        return session.info()

    def _memory_context(self, runtime: ModelRuntime) -> MemoryContext:
        return runtime.memory_context(self._embedder)

    # ---- sessions on disk ------------------------------------------------------------------

    def _save(self, session: Session) -> None:
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

    def _restore_sessions(self) -> None:
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
            if session.model not in self._models:
                log.warning("session %s on disk uses model %r, which is not served; skipped", session_id, session.model)
                continue
            self.sessions.add(session)
        log.info("%d sessions on disk", len(self.sessions))

    def _snapshot_failed(self, session_id: str, exc: Exception) -> None:
        self.snapshot_failures += 1
        log.error("session %s: unreadable snapshot, skipped and left on disk: %s", session_id, exc)

    async def _resident(self, session: Session) -> None:
        """Load a session saved on disk back into RAM, its bytes reserved first."""
        if session.memory is not None:
            return
        async with session.load_lock:
            if session.memory is not None:
                return
            context = self._memory_context(self._models[session.model])
            # what it held when saved (a preallocated cache counts whole there already)
            need = max(memory_type(session.kind).initial_bytes(context, session.options), session.cache().bytes)
            with self.sessions.reserve(session, need):
                try:
                    session.memory = await self._memory_worker(session).run(self._load_memory, session, context)
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

    def _default_memory(self, runtime: ModelRuntime) -> str:
        if self.config.default_memory != "auto":
            return self.config.default_memory
        if runtime.loaded.streaming:
            return "stream"
        kind = runtime.manifest_memory
        if kind not in runtime.memories:
            log.warning("model %s: its manifest's default memory %r is not usable here; using %r", runtime.loaded.name, kind, FALLBACK_MEMORY)
            return FALLBACK_MEMORY
        return kind

    def _memory_worker(self, session: Session) -> SerialWorker:
        """Memories that run the language model share its worker; the others use the embedder's."""
        return self._models[session.model].worker if memory_type(session.kind).runs_on_model else self._embed_worker

    def list_sessions(self) -> list[SessionInfo]:
        return [session.info() for session in self.sessions.list()]

    def get_session(self, session_id: str) -> SessionInfo:
        return self.sessions.get(session_id).info()

    def delete_session(self, session_id: str) -> None:
        self._delete_files(self.sessions.delete(session_id))
        return_free_memory()

    def cache_info(self, session_id: str) -> CacheInfo:
        return self.sessions.get(session_id).cache()

    async def clear_cache(self, session_id: str) -> CacheInfo:
        """Forget every document of the session; runs on the worker that reads the memory."""
        session = self.sessions.get(session_id)
        if session.ingest_lock.locked():
            raise ConflictError(f"session {session_id} is ingesting a document or writing an answer; clear it afterwards")
        pin = Pin(session)
        try:
            async with session.ingest_lock:  # nothing may start writing the memory while it is cleared
                await self._resident(session)
                await self._memory_worker(session).run(self._reset, session)
        finally:
            pin.release()
        return_free_memory()
        return session.cache()

    def _reset(self, session: Session) -> None:
        assert session.memory is not None
        session.memory.reset()
        session.documents.clear()
        self._save(session)

    def stats(self) -> EngineStats:
        memory_bytes: dict[str, int] = {kind: 0 for kind in MEMORIES}
        on_disk = 0
        for session in self.sessions.list():
            memory_bytes[session.kind] += session.memory_bytes
            on_disk += not session.resident
        depth = {runtime.worker.name: runtime.worker.depth for runtime in self._models.values()}
        depth[self._embed_worker.name] = self._embed_worker.depth
        batch_rows = {name: runtime.batcher.rows for name, runtime in self._models.items() if runtime.batcher is not None}
        return EngineStats(
            ready=self._ready,
            active_sessions=len(self.sessions),
            session_memory_bytes=memory_bytes,
            queue_depth=depth,
            batch_rows=batch_rows,
            queue_limit=self.config.generation.max_queue,
            memory_limit_bytes=self.config.sessions.server_memory_bytes,
            memory_reserved_bytes=self.sessions.reserved_bytes,
            sessions_on_disk=on_disk,
            snapshot_failures=self.snapshot_failures,
        )

    # ---- ingestion -------------------------------------------------------------------------

    async def ingest(self, session_id: str, text: str, name: str) -> AsyncIterator[IngestEvent]:
        """Tokenize and check the document now; the returned stream ingests it segment by segment."""
        self._require_ready()
        session = self.sessions.get(session_id)
        if not text.strip():
            raise InvalidRequestError("the document is empty")
        held: list[Releasable] = [Pin(session)]  # resident and busy until the stream ends
        with released_on_error(held):
            await self._resident(session)
            assert session.memory is not None
            tokenizer = self._models[session.model].loaded.tokenizer
            document_id = "d-" + secrets.token_hex(6)
            limit = self.config.ingest.max_document_tokens
            document = await asyncio.to_thread(tokenize_document, tokenizer, document_id, name, text, limit)
            # an early refusal; ingest_steps asks again under the ingest lock, where the memory cannot change
            estimate = session.memory.estimate_bytes(len(text), len(document.token_ids))
            reservation = self.sessions.reserve(session, estimate)
            held.append(reservation)
            held.append(self._memory_worker(session).admit())
        return EventStream(self._ingest_events(session, document, reservation), held)

    def _committed(self, session: Session, document: DocumentInfo) -> None:
        """A document is in the memory: list it and save the session before `done` is sent."""
        session.documents.append(document)
        self._save(session)

    async def _ingest_events(self, session: Session, document: Any, reservation: Reservation) -> AsyncIterator[IngestEvent]:
        """The stream's holder releases the pin and the reservation when it ends."""
        async with session.ingest_lock:
            try:
                steps = ingest_steps(
                    session.memory,
                    document,
                    segment_len=self.config.ingest.segment_len,
                    reserve=reservation.grow_to,
                    on_commit=functools.partial(self._committed, session),
                )
                async for event in self._memory_worker(session).iterate(steps):
                    if session.deleted:
                        raise NotFoundError(f"session {session.id} was deleted during ingestion")
                    yield event
            finally:
                session.last_used_at = time.time()
                return_free_memory()

    # ---- generation ------------------------------------------------------------------------

    def _check_params(self, params: GenerationParams) -> GenerationParams:
        """Bounds the HTTP schema also states, checked again here for every caller of the engine;
        fills in the generation time limit."""
        limits = self.config.generation
        if not 1 <= params.max_tokens <= limits.max_new_tokens:
            raise InvalidRequestError(f"max_tokens must be between 1 and {limits.max_new_tokens}")
        if not 0.0 <= params.temperature <= MAX_TEMPERATURE:  # also false for NaN
            raise InvalidRequestError(f"temperature must be between 0 and {MAX_TEMPERATURE:g}")
        if not 0.0 < params.top_p <= 1.0:
            raise InvalidRequestError("top_p must be above 0 and at most 1")
        if params.seed is not None and not SEED_RANGE[0] <= params.seed <= SEED_RANGE[1]:
            raise InvalidRequestError(f"seed must be between {SEED_RANGE[0]} and {SEED_RANGE[1]}")
        return dataclasses.replace(params, max_seconds=limits.max_generation_seconds)

    def _check_prompt_chars(self, messages: Messages) -> None:
        """Refuse an over-long prompt by its characters, before any tokenizing."""
        chars = sum(len(m.get("content", "")) for m in messages)
        limit = self.config.generation.max_prompt_chars
        if chars > limit:
            raise TooLargeError(f"the prompt has {chars} characters; the limit is {limit} (LONGDOC_MAX_PROMPT_CHARS)")

    async def ask(self, session_id: str, question: str, params: GenerationParams) -> AsyncIterator[GenerationEvent]:
        """Answer one question from the session's memory: a retrieval event, text deltas, then done."""
        return await self.chat([{"role": "user", "content": question}], params, None, session_id)

    async def chat(
        self, messages: Messages, params: GenerationParams, model: str | None, session_id: str | None
    ) -> AsyncIterator[GenerationEvent]:
        """Chat completion; with a session, the last user turn is answered from the session's memory."""
        self._require_ready()
        params = self._check_params(params)
        self._check_prompt_chars(messages)
        if not messages or messages[-1].get("role") != "user" or not messages[-1].get("content", "").strip():
            raise InvalidRequestError("the last message must be a non-empty user message")
        session = self.sessions.get(session_id) if session_id else None
        held: list[Releasable] = [Pin(session)] if session is not None else []
        with released_on_error(held):
            events = await self._start_chat(messages, params, model, session, held)
        return EventStream(events, held)

    async def _start_chat(
        self, messages: Messages, params: GenerationParams, model: str | None, session: Session | None, held: list[Releasable]
    ) -> AsyncIterator[GenerationEvent]:
        """Check and admit a chat; what it holds (reservation, worker slot) is appended to `held`."""
        if session is not None:
            await self._resident(session)
        if session is not None and model is not None and model != session.model:
            raise InvalidRequestError(f"session {session.id} uses model {session.model!r}, not {model!r}")
        runtime = self._runtime(session.model if session else model)
        tokenizer = runtime.loaded.tokenizer
        context_len, kv_bytes = runtime.loaded.context_len, runtime.loaded.kv_bytes_per_token
        if session is None:
            prompt_ids = await asyncio.to_thread(render, tokenizer, messages)
            self._check_context(context_len, len(prompt_ids), params)
            transient = (len(prompt_ids) + params.max_tokens) * kv_bytes
            events = self._generate(runtime, prompt_ids, params)
        else:
            memory = session.memory
            assert memory is not None
            overhead = await asyncio.to_thread(overhead_tokens, tokenizer, messages[:-1], messages[-1]["content"])
            room = memory.answer_room(context_len)
            if room is not None:
                self._check_context(room, overhead, params)
            budget = (context_len if room is None else room) - params.max_tokens - overhead
            kept, transient = memory.answer_bytes(overhead, params.max_tokens, context_len, kv_bytes)
            if kept:
                held.append(self.sessions.reserve(session, kept))
            events = self._chat_events(runtime, session, messages, params, budget)
        # what the answer allocates at its largest is reserved before it exists
        held.append(self.sessions.reserve(None, transient, transient=True))
        held.append(runtime.worker.admit())
        return events

    def _check_context(self, room: int, prompt_tokens: int, params: GenerationParams) -> None:
        if prompt_tokens + params.max_tokens > room:
            raise InvalidRequestError(
                f"the prompt has {prompt_tokens} tokens and max_tokens is {params.max_tokens}; "
                f"together they exceed the {room} tokens of context the model can take here"
            )

    async def _chat_events(
        self, runtime: ModelRuntime, session: Session, messages: Messages, params: GenerationParams, budget: int
    ) -> AsyncIterator[GenerationEvent]:
        """Retrieve up to `budget` tokens of context for the last user turn, then let the memory
        answer on the model's worker (the request's pin keeps the session busy)."""
        memory = session.memory
        assert memory is not None
        try:
            started = time.perf_counter()
            pieces: list[ContextPiece] = await self._memory_worker(session).run(memory.retrieve, messages[-1]["content"], budget)
            loaded = runtime.loaded
            request = AnswerRequest(
                loaded.model, loaded.tokenizer, runtime.stop_tokens, messages, pieces, params, time.perf_counter() - started
            )
            if memory.plain_answer and runtime.batcher is not None:
                yield memory.retrieval(request)
                prompt_ids = await asyncio.to_thread(memory.answer_prompt, request)
                async with contextlib.aclosing(self._generate(runtime, prompt_ids, params)) as answer:
                    async for event in answer:
                        yield event
                return
            lock = session.ingest_lock if memory.answer_holds_lock else contextlib.nullcontext()
            async with lock:
                async for event in runtime.worker.iterate(memory.answer_steps(request)):
                    if isinstance(event, MemoryWrite):
                        await self._write_answer(session, event, holding_lock=memory.answer_holds_lock)
                    else:
                        yield event
        finally:
            session.last_used_at = time.time()

    async def _write_answer(self, session: Session, write: MemoryWrite, *, holding_lock: bool) -> None:
        """Apply an answer's write to the memory on its worker, with no ingestion half-way, then save."""

        def apply() -> None:
            if write.apply():
                self._save(session)

        async with contextlib.nullcontext() if holding_lock else session.ingest_lock:
            await self._memory_worker(session).run(apply)

    async def _generate(self, runtime: ModelRuntime, prompt_ids: list[int], params: GenerationParams) -> AsyncIterator[GenerationEvent]:
        if runtime.batcher is not None:
            async with contextlib.aclosing(runtime.batcher.generate(prompt_ids, params)) as answer:
                async for event in answer:
                    yield event
            return
        loaded = runtime.loaded
        steps = generate_steps(loaded.model, loaded.tokenizer, prompt_ids, params, runtime.stop_tokens)
        async for event in runtime.worker.iterate(steps):
            yield event

