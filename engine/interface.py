"""The one contract between server and engine: plain data in, plain data (and async streams) out.

This module imports neither torch nor faiss, so the server can depend on it freely.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, TypeVar

MAX_TEMPERATURE = 2.0
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
# The repetition guard's defaults and bounds; it looks at the answer's own tokens only, so copying
# a phrase from the document or the question is never penalised.
NO_REPEAT_NGRAM_SIZE = 4  # an answer never repeats 4 tokens that hold a letter (engine/runtime/generation.py; 0: off)
MAX_NO_REPEAT_NGRAM_SIZE = 64
REPETITION_PENALTY = 1.0  # logits of tokens already in the answer divided by this (1: off)
MAX_REPETITION_PENALTY = 2.0


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    max_seconds: float | None = None  # wall-clock cap on decoding; the engine sets it from its limits
    no_repeat_ngram_size: int = NO_REPEAT_NGRAM_SIZE
    repetition_penalty: float = REPETITION_PENALTY
    ignore_eos: bool = False  # end-of-sequence tokens do not end the answer (benchmarks and tests of long answers)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    source: str
    architecture: str
    context_len: int
    device: str
    dtype: str
    memories: tuple[str, ...]
    quantize: str = "none"  # weight-only: "bf16", "int8" or "int4" (engine/models/quantize.py)


@dataclass(frozen=True)
class Section:
    start: int  # character offset in the document's text
    level: int  # 1 for a chapter or top heading, 2 below it, ...
    title: str


@dataclass(frozen=True)
class Layout:
    """Where a document's pages and sections start in its text (engine/documents/)."""

    format: str = "text"  # "text", "markdown", "html", "pdf", "epub" or "docx"
    pages: tuple[int, ...] = ()  # character where each page starts (PDF only); page n (1-based) is pages[n - 1]
    sections: tuple[Section, ...] = ()
    title: str | None = None

    def page_range(self, start: int, end: int) -> tuple[int, int] | None:
        """The 1-based first and last page of characters [start, end), or None without pages."""
        if not self.pages:
            return None
        first = max(1, bisect.bisect_right(self.pages, start))
        last = max(first, bisect.bisect_right(self.pages, max(start, end - 1)))
        return first, last

    def section_at(self, offset: int) -> str | None:
        """The title of the last section starting at or before `offset`; None before the first."""
        i = bisect.bisect_right(self.sections, offset, key=lambda section: section.start)
        return self.sections[i - 1].title if i else None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Layout:
        sections = tuple(Section(**s) for s in data.get("sections", ()))
        return cls(data.get("format", "text"), tuple(data.get("pages", ())), sections, data.get("title"))


@dataclass(frozen=True)
class Upload:
    """A document as a client sent it: its bytes and what the request said about them."""

    data: bytes
    media_type: str = ""  # the declared media type, without parameters ("" when none)
    filename: str | None = None
    charset: str | None = None  # the declared charset of a text body


@dataclass(frozen=True)
class ParsedDocument:
    """A document's plain text and where its pages and sections start in it."""

    text: str
    layout: Layout = field(default_factory=Layout)


@dataclass(frozen=True)
class DocumentInfo:
    id: str
    name: str
    chars: int
    tokens: int
    segments: int
    seconds: float
    warning: str | None = None  # set when the memory could not keep all of this document
    layout: Layout = field(default_factory=Layout)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DocumentInfo:
        """The inverse of `asdict` (a snapshot's metadata); a snapshot from before layouts has none."""
        layout = Layout.from_dict(data.get("layout") or {})
        return cls(**{k: v for k, v in data.items() if k != "layout"}, layout=layout)


@dataclass(frozen=True)
class CacheInfo:
    memory: str
    entries: int
    bytes: int
    capacity: int
    documents: int
    turns: int = 0  # answered turns written to the memory (neurocache with "remember")
    dropped_tokens: int = 0  # tokens of its documents the memory took but no longer holds (over capacity)
    bytes_per_token: int = 0  # what one more document token costs the memory (0: not reported)
    # text memory with `summarize`: summaries written, of those its documents' trees have when
    # whole, and "building", "ready" or "stopped: <why>" (None: the memory writes none)
    summaries: int = 0
    summaries_planned: int = 0
    summary_state: str | None = None


@dataclass(frozen=True)
class SessionInfo:
    id: str
    model: str
    memory: str
    options: dict[str, Any]
    created_at: float
    last_used_at: float
    documents: tuple[DocumentInfo, ...]
    cache: CacheInfo
    owner: str | None = None  # the API key's name that made it, when keys are configured
    resident: bool = True  # in RAM; False: saved on disk, loaded back on its next use


@dataclass(frozen=True)
class RetrievedItem:
    """One piece of memory used for an answer, located in its document by character offsets."""

    chunk_id: int
    document_id: str
    char_start: int
    char_end: int
    score: float | None = None
    layers: int | None = None  # kvcache: in how many layers the prompt pass selected this segment
    # text memory with `gather`: "whole" (every sentence naming the question's names, for a
    # whole-document question), "exact" (the sentences holding every name the question gives, one
    # hop) or "lookup" (those naming most of it, one hop, before ranked chunks); with `locate`, "tail"
    # (the last tokens of the chapter or document an ending question names) or "located" (a chunk
    # ranked within the chapter the question names); with `summarize`,
    # "summary" (a summary of characters char_start..char_end, its words in `text`); None: a ranked
    # chunk (one that took in a gathered sentence carries its mark)
    gathered: str | None = None
    text: str | None = None  # the passage's words where they are not the document's own (a summary)
    # where the passage sits, filled in from the document's layout: 1-based pages (PDF) and the
    # section (heading) it falls under
    document_name: str | None = None
    page_start: int | None = None
    page_end: int | None = None
    section: str | None = None


@dataclass(frozen=True)
class IngestProgress:
    document_id: str
    segments_done: int
    segments_total: int
    tokens_done: int
    tokens_total: int


@dataclass(frozen=True)
class IngestDone:
    document: DocumentInfo


@dataclass(frozen=True)
class Retrieval:
    memory: str
    items: tuple[RetrievedItem, ...]
    seconds: float
    # how the memory chose them; text: "ranked", or its items' marks (`gathered`) joined by "+"
    # ("whole", "located+tail", "summary+whole"); None: the memory names no strategy
    strategy: str | None = None


@dataclass(frozen=True)
class TokenDelta:
    text: str


@dataclass(frozen=True)
class GenerationDone:
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    ttft_seconds: float
    total_seconds: float


IngestEvent = IngestProgress | IngestDone
GenerationEvent = Retrieval | TokenDelta | GenerationDone


@dataclass(frozen=True)
class EngineStats:
    """Plain numbers for the metrics exporter."""

    ready: bool
    active_sessions: int
    session_memory_bytes: dict[str, int] = field(default_factory=dict)  # by memory kind
    queue_depth: dict[str, int] = field(default_factory=dict)  # by worker name
    queue_limit: int = 0  # requests each worker admits before 429
    batch_rows: dict[str, int] = field(default_factory=dict)  # answers in each batched model's decode batch
    batch_waiting: dict[str, int] = field(default_factory=dict)  # answers queued for its batch or for memory
    kv_blocks: dict[str, int] = field(default_factory=dict)  # key/value blocks its answers hold
    kv_block_bytes: dict[str, int] = field(default_factory=dict)  # bytes of one of its blocks
    kv_preemptions: dict[str, int] = field(default_factory=dict)  # answers preempted for memory since start
    prefix_tokens: dict[str, int] = field(default_factory=dict)  # positions of sessions' last prompts kept
    prefix_hits: dict[str, int] = field(default_factory=dict)  # prompts started from a kept prefix since start
    prefix_reused_tokens: dict[str, int] = field(default_factory=dict)  # prompt tokens those did not feed again
    memory_limit_bytes: int = 0  # what all sessions' memories may hold together
    memory_reserved_bytes: int = 0  # promised to work in flight, not yet committed
    sessions_on_disk: int = 0  # saved, not resident
    snapshot_failures: int = 0  # unreadable snapshots met since start


def to_dict(event: Any) -> dict[str, Any]:
    return asdict(event)


E_co = TypeVar("E_co", covariant=True)


class EventIterator(Protocol[E_co]):
    """The events of a started request (`async for`). Closing it early (`aclose`) stops the request
    and frees what it held; so does reading it to the end."""

    def __aiter__(self) -> EventIterator[E_co]: ...

    async def __anext__(self) -> E_co: ...

    async def aclose(self) -> None: ...


class EngineClient(Protocol):
    """What the HTTP layer may call. Blocking work never happens on the caller's event loop.

    Calls that start work (`ingest`, `ask`, `chat`) validate and enqueue first, raising
    `engine.errors` exceptions before any event is produced; the returned iterator then streams.
    Closing the iterator early cancels the work.
    """

    @property
    def ready(self) -> bool: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def list_models(self) -> list[ModelInfo]: ...

    def generation_defaults(self, model: str | None) -> dict[str, float]: ...

    def create_session(
        self, model: str | None, memory: str | None, options: dict[str, Any], owner: str | None = None
    ) -> SessionInfo: ...

    def list_sessions(self) -> list[SessionInfo]: ...

    def get_session(self, session_id: str) -> SessionInfo: ...

    def delete_session(self, session_id: str) -> None: ...

    def cache_info(self, session_id: str) -> CacheInfo: ...

    async def clear_cache(self, session_id: str) -> CacheInfo: ...

    async def document_text(self, session_id: str, document_id: str) -> str:
        """The text a document was ingested as; NotFoundError when the memory does not keep it."""
        ...

    async def parse(self, upload: Upload) -> ParsedDocument:
        """A file's text, pages and sections. Raises UnsupportedFormatError (415), DocumentError (422)."""
        ...

    async def ingest(self, session_id: str, document: str | ParsedDocument, name: str) -> EventIterator[IngestEvent]: ...

    async def ask(
        self, session_id: str, question: str, params: GenerationParams, documents: Sequence[str] | None = None
    ) -> EventIterator[GenerationEvent]:
        """`documents` (ids) keeps the answer to those of the session's documents (text memory)."""
        ...

    async def chat(
        self,
        messages: list[dict[str, str]],
        params: GenerationParams,
        model: str | None,
        session_id: str | None,
        documents: Sequence[str] | None = None,
    ) -> EventIterator[GenerationEvent]: ...

    def stats(self) -> EngineStats: ...
