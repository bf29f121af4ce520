"""The memory interface: what a session keeps of its documents, and how a question uses it.

A document reaches a memory as a sequence of segments between `begin_document` and
`commit_document`. Nothing is visible to `retrieve` or counted by `stats` until the commit, and
`abort_document` drops the staged document, so a failed ingestion leaves earlier documents intact.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import TypeAdapter, ValidationError
from transformers import PreTrainedTokenizerBase

from engine.errors import InvalidRequestError
from engine.interface import CacheInfo, GenerationEvent, GenerationParams, Layout, Retrieval, RetrievedItem
from engine.models.embedder import Embedder
from engine.prompts import Messages, render, with_context
from engine.runtime.generation import StopTokens, generate_steps

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.models.loader import LoadedModel


@dataclass(frozen=True)
class Segment:
    """`segment_len` tokens of one document, with each token's character span in that document."""

    document_id: str
    index: int
    token_ids: list[int]
    token_spans: list[tuple[int, int]]

    @property
    def char_start(self) -> int:
        return self.token_spans[0][0]

    @property
    def char_end(self) -> int:
        return self.token_spans[-1][1]


@dataclass(frozen=True)
class MemoryContext:
    """What the engine lends a memory."""

    tokenizer: PreTrainedTokenizerBase
    embedder: Embedder | None = None
    # per memory kind, what that memory's `model_resources` made for this model (e.g. an adapter)
    resources: Mapping[str, Any] = field(default_factory=dict)
    state_model: Any = None  # a plugin's model whose own state is the session's memory (engine/plugins.py)
    model: Any = None  # the served Hugging Face causal LM (None for a plugin's model)
    context_len: int = 0  # the served model's positions
    # per memory kind, the default options the model's manifest sets (kvcache's text index ranks with `text`'s)
    manifest_options: Mapping[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Scope:
    """What a question's retrieval may use of the session: some documents only (`documents`, ids;
    None: all), and each document's layout (its pages and sections, for questions about a place)."""

    documents: frozenset[str] | None = None
    layouts: Mapping[str, Layout] = field(default_factory=dict)


@dataclass(frozen=True)
class ContextPiece:
    """Document text a memory puts in front of the question, and where it came from."""

    text: str
    item: RetrievedItem


@dataclass(frozen=True)
class AnswerRequest:
    """What the engine hands a memory to answer the last user turn of `messages`."""

    model: Any  # the served model
    tokenizer: PreTrainedTokenizerBase
    stop_tokens: StopTokens
    messages: Messages
    pieces: list[ContextPiece]  # what `retrieve` returned for the question
    params: GenerationParams
    retrieval_seconds: float

    @property
    def question(self) -> str:
        return self.messages[-1]["content"]


@dataclass(frozen=True)
class MemoryWrite:
    """Yielded by `answer_steps` when an answer should be written into the memory: the engine runs
    `apply` on the memory's worker under the session's write lock (so no ingestion is half-way),
    saves the session if it returns True, and does not pass the event on."""

    apply: Callable[[], bool]


@dataclass(frozen=True)
class SummaryTask:
    """One summary a memory wants the served model to write in the background (engine/summarize.py):
    the chat to answer and at most how many tokens; `key`, `start` and `end` are the memory's own."""

    key: Any
    messages: Messages
    max_tokens: int
    start: int = 0
    end: int = 0


def parse_options(options_type: type, options: dict[str, Any]) -> Any:
    """Build a memory's options dataclass from a user's dict, strictly typed as JSON (no 1.5 for an
    int, no true for a number, no "3" for 3); unknown or bad values are user errors."""
    known = {f.name for f in fields(options_type)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidRequestError(f"unknown memory options {unknown}; known: {sorted(known)}")
    try:
        # JSON mode: strict there still takes an object for a dataclass (Python mode wants an instance)
        return TypeAdapter(options_type).validate_json(json.dumps(options), strict=True)
    except ValidationError as exc:
        raise InvalidRequestError(f"bad memory options: {validation_message(exc)}") from None


def validation_message(exc: ValidationError) -> str:
    """'capacity: Input should be a valid integer; ...' without pydantic's URLs and input echoes."""
    parts = []
    for error in exc.errors(include_url=False, include_input=False):
        where = ".".join(str(part) for part in error["loc"])
        parts.append(f"{where}: {error['msg']}" if where else error["msg"])
    return "; ".join(parts)


class Memory(ABC):
    kind: ClassVar[str]
    options_type: ClassVar[type | None] = None  # the dataclass its options are read into (None: not declared)
    runs_on_model: ClassVar[bool] = False  # ingestion needs the language model's worker
    answer_holds_write_lock: ClassVar[bool] = False  # answering reads state ingestion writes: hold the session's write lock
    filters_documents: ClassVar[bool] = False  # `retrieve` can keep to some of the session's documents
    # what the ingestion warning advises when a document pushed older text out of the memory
    dropped_advice: ClassVar[str] = (
        "Make the session with a larger capacity, or with memory 'text', which keeps every document whole."
    )

    @classmethod
    def read_options(cls, options: dict[str, Any]) -> Any:
        """`options` read into the memory's `options_type`; unknown or bad values are user errors."""
        assert cls.options_type is not None, f"memory {cls.kind!r} declares no options_type"
        return parse_options(cls.options_type, options)

    @abstractmethod
    def begin_document(self, document_id: str, text: str, tokens: int) -> None:
        """Start staging a document of `tokens` tokens; only one may be staged at a time."""

    @abstractmethod
    def add_segment(self, segment: Segment) -> None:
        """Stage one segment of the document begun last."""

    @abstractmethod
    def staged_bytes(self) -> int:
        """Bytes the staged document would add on commit."""

    @abstractmethod
    def commit_document(self) -> None:
        """Make the staged document part of the memory."""

    @abstractmethod
    def abort_document(self) -> None:
        """Drop the staged document; the memory is as it was before `begin_document`."""

    @classmethod
    def model_resources(cls, loaded: LoadedModel, config: EngineConfig) -> Any:
        """What a session of this memory needs from a loaded model, made once when the model is
        loaded, before its weights are quantized (an adapter, say); None: nothing. The registry
        hands it back in `MemoryContext.resources[kind]`."""
        return None

    @classmethod
    def available(cls, context: MemoryContext) -> bool:
        """Whether a session on the model behind `context` can use this memory."""
        return True

    @classmethod
    def initial_bytes(cls, context: MemoryContext, options: dict[str, Any]) -> int:
        """Bytes the memory allocates when made with these options (before any document)."""
        return 0

    @abstractmethod
    def estimate_bytes(self, chars: int, tokens: int) -> int:
        """An upper estimate of the bytes a document of this size would add."""

    @abstractmethod
    def retrieve(self, query: str, max_tokens: int, scope: Scope | None = None) -> list[ContextPiece]:
        """What to put before `query`, at most `max_tokens` tokens, in document order; with a
        `scope` naming documents, from those only (memories with `filters_documents`)."""

    # ---- answering (the defaults: document text in the prompt, the plain model answers) ---------

    def answer_room(self, context_len: int) -> int | None:
        """Prompt and answer tokens the model can take beside what the memory puts in it; None: no limit."""
        return context_len

    def answer_bytes(self, overhead: int, max_tokens: int, context_len: int, kv_bytes_per_token: int) -> tuple[int, int]:
        """At most how many bytes an answer adds to the session and, transiently, to the server.

        Args:
            overhead: prompt tokens besides any document text (question, earlier turns, template).
            max_tokens: the answer's limit.
            context_len: the served model's positions.
            kv_bytes_per_token: a generation's key/value bytes per token.
        Returns:
            (bytes the session keeps, bytes freed when the answer ends).
        """
        return 0, context_len * kv_bytes_per_token  # the prompt is filled up to the context

    def answer_steps(self, request: AnswerRequest) -> Iterator[GenerationEvent | MemoryWrite]:
        """A blocking generator run on the model's worker: one `Retrieval`, text deltas, then done."""
        yield self.retrieval(request)
        yield from generate_steps(
            request.model, request.tokenizer, self.answer_prompt(request), request.params, request.stop_tokens
        )

    @property
    def plain_answer(self) -> bool:
        """Answering is the default (the plain model on `answer_prompt`), so it can be batched with
        other requests' answers; memories that answer their own way override `answer_steps`."""
        return type(self).answer_steps is Memory.answer_steps

    def retrieval(self, request: AnswerRequest) -> Retrieval:
        return Retrieval(self.kind, tuple(p.item for p in request.pieces), request.retrieval_seconds)

    def answer_prompt(self, request: AnswerRequest) -> list[int]:
        """The prompt's ids: earlier turns, then the question with the retrieved pieces before it."""
        turn = {"role": "user", "content": with_context(request.question, request.pieces)}
        return render(request.tokenizer, [*request.messages[:-1], turn])

    def dropped_tokens(self) -> int:
        """Tokens of committed documents the memory no longer holds (a window or a full cache)."""
        return 0

    def document_text(self, document_id: str) -> str | None:
        """A committed document's text, for a memory that keeps it (None: this one does not)."""
        return None

    # ---- background summaries (engine/summarize.py; the default: none) --------------------------

    def summary_tasks(self, limit: int, busy: frozenset[Any]) -> list[SummaryTask]:
        """Up to `limit` summaries the served model can write now, none of whose keys is in `busy`."""
        return []

    def add_summary(self, task: SummaryTask, text: str) -> bool:
        """Keep what the model wrote for `task`; False when the task no longer applies (its
        document was cleared meanwhile) and nothing was kept."""
        return False

    def summary_bytes(self, task: SummaryTask) -> int:
        """At most what keeping `task`'s summary adds to the memory."""
        return 0

    summary_error: str | None = None  # why the summaries stopped, set by the engine

    @property
    def writes_summaries(self) -> bool:
        """Whether `summary_tasks` may hand out work."""
        return False

    @abstractmethod
    def stats(self) -> CacheInfo:
        """Entries, bytes, capacity and documents of what is committed."""

    @abstractmethod
    def reset(self) -> None:
        """Forget everything committed."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything committed, as arrays and plain values."""

    # set by load_state_dict when what it loaded was made again (vectors of another embedder): the
    # engine then saves the session, so the work is done once, not at every load
    remade_on_load: bool = False

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the memory's content with `state` from `state_dict`."""

    @classmethod
    def saved_options(cls, options: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        """The options to rebuild a saved memory with, from the session's (as it was made) and the
        saved `state`: those, unless the memory's defaults changed since in a way its state shows."""
        return options
