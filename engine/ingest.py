"""Ingestion: documents to segments, the blocking loop a worker drives step by step, and `Ingestion`,
which admits a document into a session and streams its progress."""

from __future__ import annotations

import asyncio
import functools
import secrets
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
from transformers import PreTrainedTokenizerBase

from engine.config import IngestConfig
from engine.errors import InvalidRequestError, NotFoundError, TooLargeError
from engine.interface import DocumentInfo, IngestDone, IngestEvent, IngestProgress, Layout, ParsedDocument
from engine.memories import Memory, Segment
from engine.runtime.os_memory import return_free_memory
from engine.runtime.worker import EventStream, Releasable, released_on_error
from engine.sessions.service import SessionService
from engine.sessions.store import Pin, Reservation, Session

PIECE_CHARS = 65_536  # documents are tokenized this many characters at a time


@dataclass(frozen=True)
class TokenizedDocument:
    id: str
    name: str
    text: str
    token_ids: np.ndarray  # int32 [n]
    token_spans: np.ndarray  # int32 [n, 2]: each token's characters in `text`
    layout: Layout = field(default_factory=Layout)

    def segments(self, segment_len: int) -> Iterator[Segment]:
        for i in range(0, len(self.token_ids), segment_len):
            yield Segment(
                document_id=self.id,
                index=i // segment_len,
                token_ids=self.token_ids[i : i + segment_len].tolist(),
                token_spans=[(a, b) for a, b in self.token_spans[i : i + segment_len].tolist()],
            )


def _is_cut(text: str, at: int) -> bool:
    """A space between two non-space characters: with a byte-level (GPT-2 style) pre-tokenizer a
    pre-token starts there in the whole text as in the piece that starts there, so tokenizing
    the two sides apart gives the same tokens as tokenizing them together."""
    return text[at] == " " and not text[at - 1].isspace() and not text[at + 1].isspace()


def piece_bounds(text: str, piece_chars: int = PIECE_CHARS) -> Iterator[tuple[int, int]]:
    """(start, end) of consecutive pieces of about `piece_chars` characters, cut where `_is_cut`
    holds. A stretch of `piece_chars` characters without such a space (no prose does that) is cut
    where it ends, which may change the tokens at that one place."""
    start = 0
    while len(text) - start > piece_chars:
        at = start + piece_chars
        limit = min(len(text) - 1, at + piece_chars)
        while at < limit and not _is_cut(text, at):
            at += 1
        yield start, at
        start = at
    yield start, len(text)


def tokenize_document(
    tokenizer: PreTrainedTokenizerBase,
    document_id: str,
    name: str,
    text: str,
    max_tokens: int | None = None,
    piece_chars: int = PIECE_CHARS,
    layout: Layout | None = None,
) -> TokenizedDocument:
    """Tokenize piece by piece; raises TooLargeError as soon as the count passes `max_tokens`, so
    a document far over the limit costs the limit's work and memory, not its own."""
    ids: list[np.ndarray] = []
    spans: list[np.ndarray] = []
    count = 0
    for start, end in piece_bounds(text, piece_chars):
        encoded = tokenizer(text[start:end], add_special_tokens=False, return_offsets_mapping=True)
        ids.append(np.asarray(encoded["input_ids"], np.int32))
        spans.append(np.asarray(encoded["offset_mapping"], np.int32).reshape(-1, 2) + start)
        count += len(ids[-1])
        if max_tokens is not None and count > max_tokens:
            raise TooLargeError(
                f"the document has more than {max_tokens} tokens (passed at character {end} of {len(text)}); "
                f"the limit is {max_tokens} (LONGDOC_MAX_DOCUMENT_TOKENS)"
            )
    return TokenizedDocument(
        id=document_id,
        name=name,
        text=text,
        layout=layout or Layout(),
        token_ids=np.concatenate(ids) if ids else np.zeros(0, np.int32),
        token_spans=np.concatenate(spans) if spans else np.zeros((0, 2), np.int32),
    )


def ingest_steps(
    memory: Memory,
    document: TokenizedDocument,
    *,
    segment_len: int,
    reserve: Callable[[int], None],
    on_commit: Callable[[DocumentInfo], None],
) -> Iterator[IngestEvent]:
    """Stage the document segment by segment, then commit; any exit before the commit aborts it.
    `reserve(n)` is told the memory's estimate before anything is staged, then the staged bytes
    after each segment, and raises when the budgets cannot hold them."""
    started = time.perf_counter()
    total_tokens = len(document.token_ids)
    n_segments = -(-total_tokens // segment_len)
    dropped_before = memory.dropped_tokens()
    # the estimate again, now that no other document can change the memory: before anything is allocated
    reserve(memory.estimate_bytes(len(document.text), total_tokens))
    memory.begin_document(document.id, document.text, total_tokens)
    committed = False
    try:
        done_tokens = 0
        for i, segment in enumerate(document.segments(segment_len)):
            memory.add_segment(segment)
            reserve(memory.staged_bytes())
            done_tokens += len(segment.token_ids)
            yield IngestProgress(document.id, i + 1, n_segments, done_tokens, total_tokens)
        memory.commit_document()
        committed = True
        info = DocumentInfo(
            id=document.id,
            name=document.name,
            chars=len(document.text),
            tokens=total_tokens,
            segments=n_segments,
            seconds=time.perf_counter() - started,
            warning=_dropped_warning(memory, memory.dropped_tokens() - dropped_before, total_tokens),
            layout=document.layout,
        )
        on_commit(info)
        yield IngestDone(info)
    finally:
        if not committed:
            memory.abort_document()


def _dropped_warning(memory: Memory, dropped: int, tokens: int) -> str | None:
    """What a user must know when the memory could not keep everything it was given."""
    if dropped <= 0:
        return None
    stats = memory.stats()
    return (
        f"the {memory.kind} memory holds at most {stats.capacity:,} tokens and this document has {tokens:,}: adding it "
        f"pushed out {dropped:,} tokens of this session's documents, the oldest first, and answers cannot use them. "
        + memory.dropped_advice
    )


class Ingestion:
    """Admits a document into a session (checked, tokenized, its bytes reserved) and streams its
    ingestion on the session's memory worker."""

    def __init__(self, config: IngestConfig, session_service: SessionService) -> None:
        self.config = config
        self.session_service = session_service
        self.on_ingested: Callable[[Session], None] = lambda session: None  # a document was committed

    async def start(self, session_id: str, parsed: ParsedDocument, name: str) -> EventStream[IngestEvent]:
        """Tokenize and check the document now; the returned event stream ingests it segment by segment."""
        session = self.session_service.use(session_id)
        text = parsed.text
        if not text.strip():
            raise InvalidRequestError("the document is empty")
        held: list[Releasable] = [Pin(session)]  # resident and busy until the event stream ends
        with released_on_error(held):
            await self.session_service.resident(session)
            assert session.memory is not None
            tokenizer = self.session_service.models.named(session.model).loaded.tokenizer
            document_id = "d-" + secrets.token_hex(6)
            document = await asyncio.to_thread(
                tokenize_document, tokenizer, document_id, name, text, self.config.max_document_tokens, layout=parsed.layout
            )
            # an early refusal; ingest_steps asks again under the write lock, where the memory cannot change
            estimate = session.memory.estimate_bytes(len(text), len(document.token_ids))
            reservation = self.session_service.store.reserve(session, estimate)
            held.append(reservation)
            held.append(self.session_service.memory_worker(session).admit())
        return EventStream(self._events(session, document, reservation), held)

    def _committed(self, session: Session, document: DocumentInfo) -> None:
        """A document is in the memory: list it and save the session before `done` is sent."""
        session.documents.append(document)
        self.session_service.save(session)

    async def _events(
        self, session: Session, document: TokenizedDocument, reservation: Reservation
    ) -> AsyncGenerator[IngestEvent, None]:
        """The event stream's holder releases the pin and the reservation when it ends."""
        memory = session.memory
        assert memory is not None, "resident since the pin"
        async with session.write_lock:
            try:
                steps = ingest_steps(
                    memory,
                    document,
                    segment_len=self.config.segment_len,
                    reserve=reservation.grow_to,
                    on_commit=functools.partial(self._committed, session),
                )
                async for event in self.session_service.memory_worker(session).iterate(steps):
                    if session.deleted:
                        raise NotFoundError(f"session {session.id} was deleted during ingestion")
                    if isinstance(event, IngestDone):
                        self.on_ingested(session)
                    yield event
            finally:
                session.last_used_at = time.time()
                return_free_memory()
