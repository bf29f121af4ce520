"""Text retrieval baseline: chunk embeddings in a per-session FAISS index, top-k chunks before the question."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import faiss
import numpy as np

from engine.embedder import Embedder
from engine.errors import BudgetExceededError
from engine.interface import CacheInfo, RetrievedItem
from engine.memories.base import ContextPiece, Memory, MemoryContext, Segment, parse_options

_CHUNK_BYTES = 2 * 8 + 4 + 4  # a chunk's span (two int64), token count and document number (int32)


@dataclass(frozen=True)
class TextOptions:
    chunk_tokens: int = 128
    top_k: int = 4
    max_chunks: int = 200_000

    def __post_init__(self) -> None:
        if not 16 <= self.chunk_tokens <= 512:
            raise ValueError("chunk_tokens must be between 16 and 512")
        if not 1 <= self.top_k <= 64:
            raise ValueError("top_k must be between 1 and 64")
        if self.max_chunks < 1:
            raise ValueError("max_chunks must be positive")


@dataclass
class _Chunks:
    """Chunks as arrays: chunk i is row i of the index, and its text is characters
    spans[i] of document documents[i]. Texts are never copied out of their document."""

    documents: np.ndarray  # int32 [n]: position in TextMemory._documents
    spans: np.ndarray  # int64 [n, 2]
    tokens: np.ndarray  # int32 [n]

    @classmethod
    def of(cls, documents: list[int], spans: list[tuple[int, int]], tokens: list[int]) -> _Chunks:
        return cls(np.asarray(documents, np.int32), np.asarray(spans, np.int64).reshape(-1, 2), np.asarray(tokens, np.int32))

    @classmethod
    def empty(cls) -> _Chunks:
        return cls.of([], [], [])

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, other: _Chunks) -> _Chunks:
        return _Chunks(
            np.concatenate([self.documents, other.documents]),
            np.concatenate([self.spans, other.spans]),
            np.concatenate([self.tokens, other.tokens]),
        )


@dataclass
class _Staged:
    document_id: str
    text: str
    spans: list[tuple[int, int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    vectors: list[np.ndarray] = field(default_factory=list)


class TextMemory(Memory):
    kind = "text"

    def __init__(self, context: MemoryContext, options: dict[str, Any]) -> None:
        self.options: TextOptions = parse_options(TextOptions, options)
        if context.embedder is None:
            raise ValueError("text memory needs an embedder")
        self._embedder: Embedder = context.embedder
        self._index = faiss.IndexFlatIP(self._embedder.dim)  # the chunks' vectors live here only
        self._chunks = _Chunks.empty()
        self._documents: list[tuple[str, str]] = []  # (id, text) of each committed document
        self._text_bytes = 0  # their texts' size in RAM: kept, as stats run on every budget check and scrape
        self._staged: _Staged | None = None

    def begin_document(self, document_id: str, text: str) -> None:
        self._staged = _Staged(document_id, text)

    def add_segment(self, segment: Segment) -> None:
        assert self._staged is not None, "begin_document first"
        staged, step = self._staged, self.options.chunk_tokens
        pieces = [segment.token_spans[start : start + step] for start in range(0, len(segment.token_ids), step)]
        if len(self._chunks) + len(staged.spans) + len(pieces) > self.options.max_chunks:
            raise BudgetExceededError(f"text memory holds at most {self.options.max_chunks} chunks")
        spans = [(piece[0][0], piece[-1][1]) for piece in pieces]
        staged.vectors.append(self._embedder.encode([staged.text[a:b] for a, b in spans]))
        staged.spans += spans
        staged.tokens += [len(piece) for piece in pieces]

    def _bytes(self, chunks: int, text_bytes: int) -> int:
        return chunks * (4 * self._embedder.dim + _CHUNK_BYTES) + text_bytes

    def staged_bytes(self) -> int:
        return 0 if self._staged is None else self._bytes(len(self._staged.spans), sys.getsizeof(self._staged.text))

    def commit_document(self) -> None:
        assert self._staged is not None, "begin_document first"
        staged = self._staged
        if staged.vectors:
            self._index.add(np.concatenate(staged.vectors))
            number = len(self._documents)
            self._chunks = self._chunks.extend(_Chunks.of([number] * len(staged.spans), staged.spans, staged.tokens))
        self._documents.append((staged.document_id, staged.text))
        self._text_bytes += sys.getsizeof(staged.text)
        self._staged = None

    def abort_document(self) -> None:
        self._staged = None

    def estimate_bytes(self, chars: int, tokens: int) -> int:
        n_chunks = -(-tokens // self.options.chunk_tokens) + 1
        return n_chunks * (4 * self._embedder.dim + _CHUNK_BYTES) + 4 * chars + 80  # 4 bytes a character at worst

    def retrieve(self, query: str, max_tokens: int) -> list[ContextPiece]:
        if self._index.ntotal == 0:
            return []
        k = min(self.options.top_k, self._index.ntotal)
        scores, rows = self._index.search(self._embedder.encode([query]), k)
        chosen: list[tuple[int, float]] = []
        budget = max_tokens
        for row, score in zip(rows[0].tolist(), scores[0].tolist(), strict=True):
            if row >= 0 and self._chunks.tokens[row] <= budget:
                chosen.append((row, score))
                budget -= int(self._chunks.tokens[row])
        chosen.sort()  # document order reads better than score order
        return [self._piece(row, score) for row, score in chosen]

    def _piece(self, row: int, score: float) -> ContextPiece:
        document_id, text = self._documents[self._chunks.documents[row]]
        start, end = (int(x) for x in self._chunks.spans[row])
        item = RetrievedItem(chunk_id=row, document_id=document_id, char_start=start, char_end=end, score=score)
        return ContextPiece(text[start:end], item)

    def stats(self) -> CacheInfo:
        return CacheInfo(
            memory=self.kind,
            entries=int(self._index.ntotal),
            bytes=self._bytes(len(self._chunks), self._text_bytes),
            capacity=self.options.max_chunks,
            documents=len(self._documents),
        )

    def reset(self) -> None:
        self._index.reset()
        self._chunks = _Chunks.empty()
        self._documents, self._staged, self._text_bytes = [], None, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "documents": [document_id for document_id, _ in self._documents],
            "document_texts": [text for _, text in self._documents],
            "vectors": self._index.reconstruct_n(0, self._index.ntotal),
            "chunk_documents": self._chunks.documents.copy(),
            "chunk_spans": self._chunks.spans.copy(),
            "chunk_tokens": self._chunks.tokens.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset()
        self._documents = list(zip(state["documents"], state["document_texts"], strict=True))
        self._text_bytes = sum(sys.getsizeof(text) for _, text in self._documents)
        self._chunks = _Chunks.of(state["chunk_documents"], state["chunk_spans"], state["chunk_tokens"])
        self._index.add(np.ascontiguousarray(state["vectors"], np.float32).reshape(-1, self._embedder.dim))
