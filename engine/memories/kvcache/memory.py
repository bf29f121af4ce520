"""kvcache memory: the session's documents as the served model's own keys and values, attended by
segment selection (engine/memories/kvcache/select.py). No training; the document stays exact.

The token sequence a session keeps: the chat template's start and "Document:", the first document, then
each later document after a blank line. Answering continues that sequence with the question (the
rest of the user turn) and generates; the store is read-only while answering.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from itertools import islice
from typing import Any, Literal

import numpy as np
import torch

from engine.interface import CacheInfo, GenerationEvent, Retrieval, RetrievedItem
from engine.memories.base import AnswerRequest, ContextPiece, Memory, MemoryContext, MemoryWrite, Scope, Segment
from engine.memories.kvcache.select import ARCHITECTURES, SelectConfig, SelectiveAnswer, SelectiveModel
from engine.memories.kvcache.store import KVStore
from engine.memories.text.memory import TextMemory
from engine.memories.text.options import TextOptions
from engine.models.llama_step import native_step
from engine.prompts import after_document, document_frame
from engine.runtime.generation import decode_steps

SEPARATOR = "\n\n"
_SPAN_BYTES = 16  # per token: its document, its characters (2) and its id, int32 each
BEFORE_TEXT = {"top_k": 8, "selection": "summary"}  # the defaults that changed on 2026-11-26 (`KVCacheOptions`)
# the `text` options the text index takes from the model's (the others shape a text prompt, or cost model passes)
INDEX_OPTIONS = ("chunk_tokens", "retrieval", "fusion", "dense_weight", "rrf_k", "max_chunks", "margin", "sentence_share")


@dataclass(frozen=True)
class KVCacheOptions:
    """A session's kvcache options. `top_k` 4 and `selection` "text" are the defaults since
    2026-11-26: on 40 development questions (As You Like It, the default model) they answered 24
    where the earlier defaults (8, "summary") answered 6 and `keys` 13 (docs/studies/kvcache.md, "The
    defaults"). `reread` since 2026-11-27: with the text index ranking as the model's `text`
    memory does (its margin included), 99 of the 120 development questions against 90
    (docs/studies/kvcache.md, "Picks read again")."""

    segment_len: int = 64  # l: tokens per selectable segment
    top_k: int = 4  # k: segments each layer and key/value head selects
    neighbours: int = 3  # u: segments taken per pick, centred on it
    window: int = 1024  # local window, tokens
    sinks: int = 64  # attention-sink tokens (the start of the sequence)
    query_chunk: int = 64  # p: prompt rows sharing one selection
    reselect_every: int = 8  # decode steps sharing one selection (1: every step selects; 0: the prompt pass's picks kept)
    ingest_selection: bool = True  # document chunks attend to selected earlier segments too
    summary: Literal["mean", "representative"] = "mean"
    representatives: int = 4  # keys kept per segment for the "representative" summary
    query_pool: Literal["mean", "max"] = "mean"  # answering: a chunk's mean query scores, or its best row
    selection: Literal["summary", "keys", "text"] = "text"  # answering: the text index picks, or the layers score
    vote: bool = False  # answering: prompt pass twice; the second attends the first's most picked segments in every layer
    reread: bool = True  # selection "text" only: the picks' tokens run again, in place of their stored keys/values
    storage: Literal["bfloat16", "int8", "float32"] = "bfloat16"

    def __post_init__(self) -> None:
        bounds = {
            "segment_len": (8, 1024),
            "top_k": (1, 256),
            "neighbours": (1, 9),
            "window": (16, 65536),
            "sinks": (0, 4096),
            "query_chunk": (1, 4096),
            "reselect_every": (0, 4096),
            "representatives": (1, 64),
        }
        for name, (low, high) in bounds.items():
            if not low <= getattr(self, name) <= high:
                raise ValueError(f"{name} must be between {low} and {high}")
        if self.window < self.segment_len:
            raise ValueError("window must be at least segment_len")
        if self.representatives > self.segment_len:
            raise ValueError("representatives must be at most segment_len")
        if self.vote and self.selection == "text":
            raise ValueError('vote needs a selection that scores ("summary" or "keys"), not "text"')

    def select_config(self) -> SelectConfig:
        fields = asdict(self)
        fields.pop("storage")
        return SelectConfig(**fields)


class KVCacheMemory(Memory):
    kind = "kvcache"
    options_type = KVCacheOptions
    runs_on_model = True
    answer_holds_write_lock = True  # the answer reads the store an ingestion appends to

    def __init__(self, context: MemoryContext, options: dict[str, Any]) -> None:
        self.options: KVCacheOptions = self.read_options(options)
        if not self.available(context):
            raise ValueError(f"memory 'kvcache' needs a served Llama-family model ({', '.join(ARCHITECTURES)})")
        self.selective = SelectiveModel(context.model, self.options.select_config(), native_step(context.model))
        room = context.context_len - self.selective.config.positions()
        if room < 256:
            raise ValueError(
                f"sinks + top_k·neighbours·segment_len + window + segment_len = {self.selective.config.positions()} positions "
                f"leave {room} of the model's {context.context_len} for the question and answer; at least 256 are needed"
            )
        self._room = room
        tokenizer = context.tokenizer
        self._prefix = tokenizer(document_frame(tokenizer)[0], add_special_tokens=False)["input_ids"]
        self._separator = tokenizer(SEPARATOR, add_special_tokens=False)["input_ids"]
        shape = self.selective.store_shape(self.options.storage)
        self.store = KVStore(shape, device=self.selective.device, dtype=self.selective.dtype)
        self._documents: list[str] = []
        self._token_doc = np.zeros(0, np.int32)  # per fed token: its document's number, -1 for template text
        self._token_ids = np.zeros(0, np.int32)  # per fed token: its id (`reread`)
        self._token_spans = np.zeros((0, 2), np.int32)
        self._staged: dict[str, Any] | None = None
        self._committed = (0, 0)  # (bytes, tokens) that stats count: never a document being fed
        # selection "text": the text memory's index of the same documents picks the segments
        self.text_index: TextMemory | None = None
        if self.options.selection == "text":
            if context.embedder is None:
                raise ValueError(
                    'kvcache\'s selection "text" (the default) needs the text embedder, which this server has not '
                    'loaded; make the session with {"selection": "summary"} or {"selection": "keys"}'
                )
            self.text_index = TextMemory(
                context, {k: v for k, v in context.manifest_options.get("text", {}).items() if k in INDEX_OPTIONS}
            )

    @classmethod
    def available(cls, context: MemoryContext) -> bool:
        return context.model is not None and getattr(context.model.config, "model_type", None) in ARCHITECTURES

    # ---- ingestion -----------------------------------------------------------------------------

    def begin_document(self, document_id: str, text: str, tokens: int) -> None:
        lead = self._separator if self.store.tokens else self._prefix
        self._staged = {
            "id": document_id,
            "mark": self.store.mark(),
            "bytes": self._bytes(),
            "arrays": (self._token_doc, self._token_spans, self._token_ids),
        }
        self.store.reserve(tokens + len(lead))
        self._feed(lead, -1, [(0, 0)] * len(lead))
        if self.text_index is not None:
            self.text_index.begin_document(document_id, text, tokens)

    def add_segment(self, segment: Segment) -> None:
        assert self._staged is not None, "begin_document first"
        self._feed(segment.token_ids, len(self._documents), segment.token_spans)
        if self.text_index is not None:
            self.text_index.add_segment(segment)

    def _feed(self, token_ids: list[int], document: int, spans: list[tuple[int, int]]) -> None:
        # a chunk's tokens sit after the layout's positions: pieces of at most `room` keep them in the model's
        for at in range(0, len(token_ids), self._room):
            self.selective.feed(self.store, token_ids[at : at + self._room])
        self._token_doc = np.concatenate([self._token_doc, np.full(len(token_ids), document, np.int32)])
        self._token_ids = np.concatenate([self._token_ids, np.asarray(token_ids, np.int32)])
        self._token_spans = np.concatenate([self._token_spans, np.asarray(spans, np.int32).reshape(-1, 2)])

    def _bytes(self) -> int:
        return self.store.nbytes + len(self._token_doc) * _SPAN_BYTES

    def staged_bytes(self) -> int:
        staged = 0 if self._staged is None else self._bytes() - self._staged["bytes"]
        return staged + (self.text_index.staged_bytes() if self.text_index is not None else 0)

    def estimate_bytes(self, chars: int, tokens: int) -> int:
        """The store's growth, the new token indexes, and the copies of the old ones kept for an abort."""
        lead = max(len(self._prefix), len(self._separator))
        text = self.text_index.estimate_bytes(chars, tokens) if self.text_index is not None else 0
        return self.store.added_bytes(tokens + lead) + (tokens + lead + len(self._token_doc)) * _SPAN_BYTES + text

    def commit_document(self) -> None:
        assert self._staged is not None, "begin_document first"
        self.store.trim()
        if self.text_index is not None:
            self.text_index.commit_document()  # may fail, changing nothing: an abort then rolls the store back
        self._documents.append(self._staged["id"])
        self._staged = None
        self._committed = (self._bytes(), self.store.tokens)

    def abort_document(self) -> None:
        if self._staged is not None:
            self.store.rollback(self._staged["mark"])
            self._token_doc, self._token_spans, self._token_ids = self._staged["arrays"]
        self._staged = None
        if self.text_index is not None:
            self.text_index.abort_document()

    def token_at(self, document: int, char: int) -> int | None:
        """The store row of the token holding character `char` of the `document`-th document fed
        (the inverse of the retrieval items' offsets), or None."""
        rows = self._rows(document, char, char + 1)
        return int(rows[0]) if len(rows) else None

    def _rows(self, document: int, start: int, end: int) -> np.ndarray:
        """The store rows of the tokens holding any of characters start..end-1 of the `document`-th document."""
        spans = self._token_spans
        return np.flatnonzero((self._token_doc == document) & (spans[:, 0] < end) & (start < spans[:, 1]))

    # ---- answering -----------------------------------------------------------------------------

    def retrieve(self, query: str, max_tokens: int, scope: Scope | None = None) -> list[ContextPiece]:
        return []  # each layer selects segments itself, while answering

    def answer_room(self, context_len: int) -> int | None:
        return self._room

    def answer_bytes(self, overhead: int, max_tokens: int, context_len: int, kv_bytes_per_token: int) -> tuple[int, int]:
        """The answer's buffers (sinks, the selected segments, the window and its own tokens) and its
        normalised copy of the summaries."""
        buffers = (self.selective.config.positions() + overhead + max_tokens) * kv_bytes_per_token
        return 0, buffers + self.store.shape.summary_bytes(self.store.segments)

    def answer_steps(self, request: AnswerRequest) -> Iterator[GenerationEvent | MemoryWrite]:
        tokenizer = request.tokenizer
        after = tokenizer(after_document(tokenizer, request.messages[:-1], request.question), add_special_tokens=False)[
            "input_ids"
        ]
        prompt = after if self.store.tokens else self._prefix + after  # an empty session: the template's start first
        answer, picking = self.selective_answer(request.question, len(prompt) + request.params.max_tokens)
        steps = decode_steps(answer.forward, tokenizer, prompt, request.params, request.stop_tokens)
        first = next(steps)  # the prompt pass selects; its picks are the answer's sources
        yield Retrieval(self.kind, self._items(answer), picking + answer.prompt_selection_seconds)
        yield first
        yield from steps

    def selective_answer(self, question: str, new_tokens: int) -> tuple[SelectiveAnswer, float]:
        """An answer over the store for `question`, feeding at most `new_tokens` (with selection
        "text" the text index's picks, their tokens run again with `reread`), and the seconds the
        text index took to pick."""
        started = time.perf_counter()
        picks = self.text_picks(question)
        picking = time.perf_counter() - started if picks is not None else 0.0
        return SelectiveAnswer(self.selective, self.store, new_tokens, picks, self._pick_tokens(picks)), picking

    def text_picks(self, question: str) -> list[int] | None:
        """Segments for selection "text" (None for the others, whose layers select): those of the
        text index's best chunks for the question, in its order, until the layout's k·u places are
        full (when the best chunks' segments are fewer, the next chunks' fill them); with the text
        index's `margin`, only chunks within it of the first, so the places may stay part empty.
        Segments in the local window are attended anyway and are skipped."""
        if self.text_index is None or self.selective.config.selection != "text":
            return None
        eligible = self.selective.eligible(self.store, self.store.tokens)
        want = self.selective.config.places(eligible)
        ranked = self.text_index.ranked_spans(question) if want else []
        margin = self.text_index.options.score_margin()
        floor = ranked[0][3] - margin if ranked and margin else -math.inf
        chosen: list[int] = []
        for document_id, start, end, score in ranked:
            if score < floor:
                return sorted(chosen)
            chosen += [
                s for s in self._segments(self._documents.index(document_id), start, end) if s < eligible and s not in chosen
            ]
            if len(chosen) >= want:
                break
        chosen = chosen[:want]
        chosen += islice((s for s in range(eligible) if s not in chosen), want - len(chosen))  # a short ranking
        return sorted(chosen)

    def _pick_tokens(self, picks: list[int] | None) -> list[int] | None:
        """With `reread`, the token ids of `picks` (sorted, as `text_picks` returns them), in order."""
        if picks is None or not self.selective.config.reread:
            return None
        sinks, l = self.selective.config.sinks, self.selective.config.segment_len
        return [int(t) for p in picks for t in self._token_ids[sinks + p * l : sinks + (p + 1) * l]]

    def _segments(self, document: int, start: int, end: int) -> list[int]:
        """The segments holding characters start..end-1 of the `document`-th document, in order."""
        sinks, l = self.selective.config.sinks, self.selective.config.segment_len
        return sorted({(int(r) - sinks) // l for r in self._rows(document, start, end) if r >= sinks})

    def _items(self, answer: SelectiveAnswer) -> tuple[RetrievedItem, ...]:
        """The segments the prompt pass selected, in document order, with how many layers picked each."""
        items = []
        sinks, l = self.selective.config.sinks, self.selective.config.segment_len
        for segment, layers in sorted(answer.picked.items()):
            rows = slice(sinks + segment * l, sinks + (segment + 1) * l)
            docs = self._token_doc[rows]
            in_document = np.flatnonzero(docs >= 0)
            if not len(in_document):
                continue
            document = int(docs[in_document[0]])
            mine = in_document[docs[in_document] == document]
            spans = self._token_spans[rows][mine]
            items.append(
                RetrievedItem(
                    chunk_id=segment,
                    document_id=self._documents[document],
                    char_start=int(spans[0, 0]),
                    char_end=int(spans[-1, 1]),
                    score=None,
                    layers=layers,
                )
            )
        return tuple(items)

    # ---- state ---------------------------------------------------------------------------------

    def stats(self) -> CacheInfo:
        return CacheInfo(
            memory=self.kind,
            entries=self._committed[1],
            bytes=self._committed[0] + self._text_stats_bytes(),
            capacity=0,  # unbounded: the session's byte budget is the limit
            documents=len(self._documents),
            bytes_per_token=self.store.shape.bytes_per_token() + _SPAN_BYTES,
        )

    def _text_stats_bytes(self) -> int:
        return self.text_index.stats().bytes if self.text_index is not None else 0

    def reset(self) -> None:
        self.store = KVStore(self.store.shape, device=self.store.device, dtype=self.store.dtype)
        self._documents, self._staged = [], None
        self._token_doc, self._token_spans = np.zeros(0, np.int32), np.zeros((0, 2), np.int32)
        self._token_ids = np.zeros(0, np.int32)
        self._committed = (self._bytes(), 0)
        if self.text_index is not None:
            self.text_index.reset()

    def state_dict(self) -> dict[str, Any]:
        return {
            "options": asdict(self.options),
            "documents": list(self._documents),
            "store": self.store.state_dict(),
            "token_doc": torch.from_numpy(self._token_doc),
            "token_spans": torch.from_numpy(self._token_spans),
            "token_ids": torch.from_numpy(self._token_ids),
            **(
                {"text": self.text_index.state_dict(), "text_options": asdict(self.text_index.options)}
                if self.text_index is not None
                else {}
            ),
        }

    @classmethod
    def saved_options(cls, options: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        """Saved since 2026-11-26, the state holds the options it was made with, defaults resolved;
        a state from before holds none, and was made under that time's defaults (`BEFORE_TEXT`).
        A state saved before `reread` (2026-11-27) holds no token ids, and answers without it."""
        saved = dict(state["options"]) if "options" in state else {**BEFORE_TEXT, **options}
        return saved if "token_ids" in state else {**saved, "reread": False}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset()
        self.store.load_state_dict(state["store"])
        self._documents = list(state["documents"])
        self._token_doc = state["token_doc"].numpy().astype(np.int32)
        self._token_spans = state["token_spans"].numpy().astype(np.int32).reshape(-1, 2)
        # a state from before `reread` holds no token ids (and answers without it): -1 keeps the rows aligned
        unknown = np.full(len(self._token_doc), -1, np.int32)
        self._token_ids = state["token_ids"].numpy().astype(np.int32) if "token_ids" in state else unknown
        if self.text_index is not None:
            # the ranking it was made with (one saved before 2026-11-27 ranked with the text memory's
            # built-in defaults), set first: it decides whether sentences are loaded
            self.text_index.options = TextOptions(**state.get("text_options", {}))
            self.text_index.load_state_dict(state["text"])
        self._committed = (self._bytes(), self.store.tokens)
