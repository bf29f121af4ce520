"""Answering: chat completions with or without a session, checked and admitted before any event,
then generated on the model's worker (decode-batched where the model allows)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, Callable, Sequence

from engine.config import GenerationLimits
from engine.errors import InvalidRequestError, NotFoundError, TooLargeError
from engine.interface import MAX_TEMPERATURE, SEED_RANGE, DocumentInfo, GenerationEvent, GenerationParams, Retrieval
from engine.memories import ContextPiece, Scope, memory_type
from engine.memories.base import AnswerRequest, MemoryWrite
from engine.prompts import Messages, overhead_tokens, render
from engine.runtime.generation import generate_steps
from engine.runtime.prefix_cache import Owner
from engine.runtime.registry import ModelRuntime
from engine.runtime.worker import EventStream, Releasable, released_on_error
from engine.sessions.service import SessionService
from engine.sessions.store import Pin, Session


class Answering:
    def __init__(self, limits: GenerationLimits, session_service: SessionService) -> None:
        self.limits = limits
        self.session_service = session_service
        self.models = session_service.models

    def _check_params(self, params: GenerationParams) -> GenerationParams:
        """Bounds the HTTP schema also states, checked again here for every caller of the engine;
        fills in the generation time limit."""
        limits = self.limits
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
        limit = self.limits.max_prompt_chars
        if chars > limit:
            raise TooLargeError(f"the prompt has {chars} characters; the limit is {limit} (LONGDOC_MAX_PROMPT_CHARS)")

    async def chat(
        self,
        messages: Messages,
        params: GenerationParams,
        model: str | None,
        session_id: str | None,
        documents: Sequence[str] | None = None,
    ) -> EventStream[GenerationEvent]:
        """Chat completion; with a session, the last user turn is answered from the session's memory
        (from `documents` of it only, when given)."""
        params = self._check_params(params)
        self._check_prompt_chars(messages)
        if not messages or messages[-1].get("role") != "user" or not messages[-1].get("content", "").strip():
            raise InvalidRequestError("the last message must be a non-empty user message")
        session = self.session_service.use(session_id) if session_id else None
        chosen = _chosen_documents(session, documents)
        held: list[Releasable] = [Pin(session)] if session is not None else []
        with released_on_error(held):
            events = await self._admit(messages, params, model, session, held, chosen)
        return EventStream(events, held)

    async def _admit(
        self,
        messages: Messages,
        params: GenerationParams,
        model: str | None,
        session: Session | None,
        held: list[Releasable],
        documents: frozenset[str] | None,
    ) -> AsyncGenerator[GenerationEvent, None]:
        """Check and admit a chat; what it holds (reservation, worker slot) is appended to `held`."""
        if session is not None:
            await self.session_service.resident(session)
        if session is not None and model is not None and model != session.model:
            raise InvalidRequestError(f"session {session.id} uses model {session.model!r}, not {model!r}")
        runtime = self.models.runtime(session.model if session else model)
        tokenizer = runtime.loaded.tokenizer
        context_len, kv_bytes = runtime.loaded.context_len, runtime.loaded.kv_bytes_per_token
        store = self.session_service.store
        # a batched answer's keys and values are held in blocks by the batcher as they fill (kv_blocks.py)
        blocks = runtime.batcher.kv if runtime.batcher is not None else None
        if session is None:
            prompt_ids = await asyncio.to_thread(render, tokenizer, messages)
            _check_context(context_len, len(prompt_ids), params)
            transient = (len(prompt_ids) + params.max_tokens) * kv_bytes
            if blocks is not None:  # 413 now for an answer that could never fit
                store.check_fits(blocks.peak_bytes(len(prompt_ids) + params.max_tokens))
                transient = 0
            events = generate_events(runtime, prompt_ids, params)
        else:
            memory = session.memory
            assert memory is not None
            overhead = await asyncio.to_thread(overhead_tokens, tokenizer, messages[:-1], messages[-1]["content"])
            room = memory.answer_room(context_len)
            if room is not None:
                _check_context(room, overhead, params)
            budget = (context_len if room is None else room) - params.max_tokens - overhead
            if blocks is not None and memory.plain_answer:  # at least the prompt without excerpts
                store.check_fits(blocks.peak_bytes(overhead + params.max_tokens))
                kv_bytes = 0  # what the answer's prompt and tokens take is held by the batcher
            kept, transient = memory.answer_bytes(overhead, params.max_tokens, context_len, kv_bytes)
            reservation = store.reserve(session, kept)
            held.append(reservation)

            def recount() -> None:  # under the session's lock: what it holds may have changed since
                reservation.grow_to(memory.answer_bytes(overhead, params.max_tokens, context_len, kv_bytes)[0])

            events = self._session_events(runtime, session, messages, params, budget, recount, documents)
        # what the answer allocates at its largest is reserved before it exists
        held.append(store.reserve(None, transient, transient=True))
        held.append(runtime.worker.admit())
        return events

    async def _session_events(
        self,
        runtime: ModelRuntime,
        session: Session,
        messages: Messages,
        params: GenerationParams,
        budget: int,
        recount: Callable[[], None],
        documents: frozenset[str] | None,
    ) -> AsyncGenerator[GenerationEvent, None]:
        """Retrieve up to `budget` tokens of context for the last user turn, then let the memory
        answer on the model's worker (the request's pin keeps the session busy). A memory whose
        answer writes to it counts what the answer keeps again once it holds the session's lock
        (`recount`): a document committed or dropped since admission changes what that is."""
        memory = session.memory
        assert memory is not None
        worker = self.session_service.memory_worker(session)
        try:
            started = time.perf_counter()
            scope = Scope(documents, {document.id: document.layout for document in session.documents})
            pieces: list[ContextPiece] = await worker.run(memory.retrieve, messages[-1]["content"], budget, scope)
            loaded = runtime.loaded
            request = AnswerRequest(
                loaded.model, loaded.tokenizer, runtime.stop_tokens, messages, pieces, params, time.perf_counter() - started
            )
            if memory.plain_answer and runtime.batcher is not None:
                yield placed(memory.retrieval(request), session.documents)
                prompt_ids = await asyncio.to_thread(memory.answer_prompt, request)
                answer_events = generate_events(runtime, prompt_ids, params, owner=session)
                async with contextlib.aclosing(answer_events) as answer:
                    async for event in answer:
                        yield event
                return
            lock = session.write_lock if memory.answer_holds_write_lock else contextlib.nullcontext()
            async with lock:
                if memory.answer_holds_write_lock:
                    recount()
                async for step in runtime.worker.iterate(memory.answer_steps(request)):
                    if isinstance(step, MemoryWrite):
                        await self._write_answer(session, step, holding_lock=memory.answer_holds_write_lock)
                    else:
                        yield placed(step, session.documents) if isinstance(step, Retrieval) else step
        finally:
            session.last_used_at = time.time()

    async def _write_answer(self, session: Session, write: MemoryWrite, *, holding_lock: bool) -> None:
        """Apply an answer's write to the memory on its worker, with no ingestion half-way, then save."""

        def apply() -> None:
            if write.apply():
                self.session_service.save(session)

        async with contextlib.nullcontext() if holding_lock else session.write_lock:
            await self.session_service.memory_worker(session).run(apply)


async def generate_events(
    runtime: ModelRuntime,
    prompt_ids: list[int],
    params: GenerationParams,
    *,
    background: bool = False,
    owner: Owner | None = None,
) -> AsyncGenerator[GenerationEvent, None]:
    """The model's answer to `prompt_ids`: decode-batched where the model allows (`background`
    work queued behind the answers; an `owner`'s prompts start from what they share with its last
    one), else alone on its worker."""
    if runtime.batcher is not None:
        answer_events = runtime.batcher.generate(prompt_ids, params, background=background, owner=owner)
        async with contextlib.aclosing(answer_events) as answer:
            async for event in answer:
                yield event
        return
    loaded = runtime.loaded
    steps = generate_steps(loaded.model, loaded.tokenizer, prompt_ids, params, runtime.stop_tokens)
    async for event in runtime.worker.iterate(steps):
        yield event


def _chosen_documents(session: Session | None, documents: Sequence[str] | None) -> frozenset[str] | None:
    """The documents a request keeps its answer to, checked against the session and its memory."""
    if documents is None:
        return None
    if session is None:
        raise InvalidRequestError("'documents' needs a session: name one with session_id")
    unknown = sorted(set(documents) - {document.id for document in session.documents})
    if unknown:
        raise NotFoundError(f"session {session.id} has no document {', '.join(map(repr, unknown))}")
    if not documents:
        raise InvalidRequestError("'documents' is empty: name at least one, or leave it out for all")
    if not memory_type(session.kind).filters_documents:
        raise InvalidRequestError(
            f"the {session.kind} memory answers from all of a session's documents; 'documents' needs a text session"
        )
    return frozenset(documents)


def placed(retrieval: Retrieval, documents: list[DocumentInfo]) -> Retrieval:
    """Each passage with its document's name, its pages (PDF) and the section it falls under."""
    by_id = {document.id: document for document in documents}
    items = []
    for item in retrieval.items:
        document = by_id.get(item.document_id)
        if document is None:
            items.append(item)
            continue
        pages = document.layout.page_range(item.char_start, item.char_end) or (None, None)
        section = document.layout.section_at(item.char_start)
        items.append(
            dataclasses.replace(item, document_name=document.name, page_start=pages[0], page_end=pages[1], section=section)
        )
    return dataclasses.replace(retrieval, items=tuple(items))


def _check_context(room: int, prompt_tokens: int, params: GenerationParams) -> None:
    if prompt_tokens + params.max_tokens > room:
        raise InvalidRequestError(
            f"the prompt has {prompt_tokens} tokens and max_tokens is {params.max_tokens}; "
            f"together they exceed the {room} tokens of context the model can take here"
        )
