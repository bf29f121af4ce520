"""The engine behind `engine.interface.EngineClient`: the served models (registry.py), sessions
(session_service.py), ingestion (ingest.py) and answering (answering.py), started and stopped together."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.answering import Answering
from engine.config import EngineConfig
from engine.documents import detect_format, parse_cost, parse_detected
from engine.documents.parsers import plain_text
from engine.errors import NotReadyError, RetryLaterError
from engine.ingest import Ingestion
from engine.interface import (
    CacheInfo,
    EngineStats,
    EventIterator,
    GenerationEvent,
    GenerationParams,
    IngestEvent,
    ModelInfo,
    ParsedDocument,
    SessionInfo,
    Upload,
)
from engine.memories import MEMORIES
from engine.models.embedder import Embedder
from engine.models.loader import resolve_device, resolve_dtype
from engine.plugins import load_plugins
from engine.prompts import Messages
from engine.runtime.os_memory import return_free_memory
from engine.runtime.registry import ModelRegistry
from engine.runtime.worker import on_compute_thread, single_threaded_torch
from engine.sessions.service import SessionService
from engine.summarize import Summarizer

log = logging.getLogger(__name__)


class Engine:
    """Owns every model and session. Blocking work runs on the workers, never on the event loop."""

    def __init__(self, config: EngineConfig, *, embedder_factory: Callable[[], Embedder] | None = None) -> None:
        self.config = config
        load_plugins()  # before anything reads the memory registry
        # batched answers hold their keys and values from the server's budget as they fill them
        self.models = ModelRegistry(
            config,
            self._require_ready,
            lambda nbytes: self.sessions.reserve(None, nbytes, transient=True),
            lambda nbytes: self.sessions.reserve(None, nbytes, transient=True, optional=True),
        )
        self.session_service = SessionService(config, self.models)
        self.sessions = self.session_service.store
        self.ingestion = Ingestion(config.ingest, self.session_service)
        self.answering = Answering(config.generation, self.session_service)
        self.summarizer = Summarizer(self.session_service)  # background summaries, where a memory writes them
        self.session_service.on_loaded = self.ingestion.on_ingested = self.summarizer.ensure
        self._embedder_factory = embedder_factory or self._default_embedder
        self._reaper: asyncio.Task[None] | None = None
        self._ready = False
        self._parse_slots = threading.BoundedSemaphore(config.parse.max_parallel)

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready

    def _default_embedder(self) -> Embedder:
        device = resolve_device(self.config.models.device)
        return Embedder(
            adapter=self.config.embedder_adapter, device=device, dtype=resolve_dtype(self.config.models.dtype, device)
        )

    def _load(self) -> None:
        self.models.load_all()
        for runtime in self.models.runtimes():  # kept prompts give their memory back to any other
            prefix = runtime.batcher.prefix if runtime.batcher is not None else None  # reservation, and go with their session
            if prefix is not None:
                prefix.share_lock(self.sessions.books_lock)
                self.sessions.reclaimers.append(prefix.reclaim)
                self.sessions.on_leave.append(prefix.drop)
        self.session_service.embedder = self._embedder_factory()
        self.session_service.restore()

    async def start(self) -> None:
        """Load models and list saved sessions on the compute thread, then start evicting idle sessions.
        The event loop's own torch calls run single-threaded, and so do those of its default
        executor's threads (`asyncio.to_thread`), so only the compute thread has a team of torch's
        OpenMP runtime (engine/runtime/worker.py)."""
        single_threaded_torch()
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="longdoc-io", initializer=single_threaded_torch))
        await on_compute_thread(self._load)
        self._ready = True
        self._reaper = asyncio.create_task(self._reap_idle_sessions())

    async def stop(self) -> None:
        self._ready = False
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.summarizer.stop()
        self.models.shutdown()
        self.session_service.embed_worker.shutdown()

    async def _reap_idle_sessions(self) -> None:
        period = min(30.0, self.config.sessions.idle_ttl_seconds / 4)
        while True:
            await asyncio.sleep(period)
            self.sessions.evict_idle()
            return_free_memory()

    def _require_ready(self) -> None:
        if not self._ready:
            raise NotReadyError("the server is still loading its models")

    # ---- EngineClient ----------------------------------------------------------------------

    def tokenizer(self, model: str | None = None) -> Any:
        """The tokenizer of a loaded model (the first by default)."""
        return self.models.runtime(model).loaded.tokenizer

    def generation_defaults(self, model: str | None) -> dict[str, float]:
        """The sampling a model's manifest sets for OpenAI requests that leave it out (the first
        model's by default; none for a model not served, which `chat` then refuses in its order)."""
        if model is not None and not self.models.serves(model):
            return {}
        return self.models.runtime(model).generation_defaults

    def list_models(self) -> list[ModelInfo]:
        return [runtime.info() for runtime in self.models.runtimes()]

    def create_session(
        self, model: str | None, memory: str | None, options: dict[str, Any], owner: str | None = None
    ) -> SessionInfo:
        return self.session_service.create(model, memory, options, owner)

    def list_sessions(self) -> list[SessionInfo]:
        return [session.info() for session in self.session_service.list()]

    def get_session(self, session_id: str) -> SessionInfo:
        return self.session_service.use(session_id).info()

    def delete_session(self, session_id: str) -> None:
        """Delete the session; its summaries' build, if one runs, stops."""
        self.session_service.delete(session_id)
        self.summarizer.cancel(session_id)

    def cache_info(self, session_id: str) -> CacheInfo:
        return self.session_service.use(session_id).cache()

    async def clear_cache(self, session_id: str) -> CacheInfo:
        return await self.session_service.clear(session_id)

    async def document_text(self, session_id: str, document_id: str) -> str:
        return await self.session_service.document_text(session_id, document_id)

    async def parse(self, upload: Upload) -> ParsedDocument:
        """A file's text, pages and sections (engine/documents/), its format found off the event
        loop. What the parse may take is reserved from the server's memory budget, and a slot of
        `max_parallel` held, until the parse ends, even when the request is gone first (429 when
        the server is full or every slot is busy)."""
        limits = self.config.parse
        if not self._parse_slots.acquire(blocking=False):
            raise RetryLaterError(f"{limits.max_parallel} files are being parsed; retry shortly", retry_after=2.0)
        try:
            format = await asyncio.to_thread(detect_format, upload.data, upload.media_type, upload.filename)
            reservation = self.sessions.reserve(None, parse_cost(upload, format, limits), transient=True)
        except BaseException:
            self._parse_slots.release()
            raise

        def parse_holding() -> ParsedDocument:
            try:
                return parse_detected(upload, format, limits)
            finally:
                reservation.release()
                self._parse_slots.release()

        return await asyncio.to_thread(parse_holding)

    async def ingest(self, session_id: str, document: str | ParsedDocument, name: str) -> EventIterator[IngestEvent]:
        """Ingest plain text, or a parsed document whose pages and sections its passages will cite."""
        self._require_ready()
        parsed = plain_text(document) if isinstance(document, str) else document
        return await self.ingestion.start(session_id, parsed, name)

    async def ask(
        self, session_id: str, question: str, params: GenerationParams, documents: Sequence[str] | None = None
    ) -> EventIterator[GenerationEvent]:
        """Answer one question from the session's memory (from `documents` of it only, when given):
        a retrieval event, text deltas, then done."""
        return await self.chat([{"role": "user", "content": question}], params, None, session_id, documents)

    async def chat(
        self,
        messages: Messages,
        params: GenerationParams,
        model: str | None,
        session_id: str | None,
        documents: Sequence[str] | None = None,
    ) -> EventIterator[GenerationEvent]:
        self._require_ready()
        return await self.answering.chat(messages, params, model, session_id, documents)

    def stats(self) -> EngineStats:
        memory_bytes: dict[str, int] = {kind: 0 for kind in MEMORIES}
        on_disk = 0
        for session in self.sessions.list():
            memory_bytes[session.kind] += session.memory_bytes
            on_disk += not session.resident
        runtimes = self.models.runtimes()
        depth = {runtime.worker.name: runtime.worker.depth for runtime in runtimes}
        embed_worker = self.session_service.embed_worker
        depth[embed_worker.name] = embed_worker.depth
        batchers = {runtime.loaded.name: runtime.batcher for runtime in runtimes if runtime.batcher is not None}
        blocks = {name: batcher.kv for name, batcher in batchers.items() if batcher.kv is not None}
        prefixes = {name: batcher.prefix for name, batcher in batchers.items() if batcher.prefix is not None}
        return EngineStats(
            ready=self._ready,
            active_sessions=len(self.sessions),
            session_memory_bytes=memory_bytes,
            queue_depth=depth,
            batch_rows={name: batcher.rows for name, batcher in batchers.items()},
            batch_waiting={name: batcher.waiting for name, batcher in batchers.items()},
            kv_blocks={name: kv.in_use for name, kv in blocks.items()},
            kv_block_bytes={name: kv.block_bytes for name, kv in blocks.items()},
            kv_preemptions={name: kv.preemptions for name, kv in blocks.items()},
            prefix_tokens={name: prefix.tokens for name, prefix in prefixes.items()},
            prefix_hits={name: prefix.hits for name, prefix in prefixes.items()},
            prefix_reused_tokens={name: prefix.reused_tokens for name, prefix in prefixes.items()},
            queue_limit=self.config.generation.max_queue,
            memory_limit_bytes=self.config.sessions.server_memory_bytes,
            memory_reserved_bytes=self.sessions.reserved_bytes,
            sessions_on_disk=on_disk,
            snapshot_failures=self.session_service.snapshot_failures,
        )
