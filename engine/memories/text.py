"""Text retrieval baseline: chunk embeddings in a per-session FAISS index, top-k chunks before the question."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np

from engine.embedder import Embedder
from engine.errors import BudgetExceededError
from engine.interface import CacheInfo, RetrievedItem
from engine.memories.base import ContextPiece, Memory, MemoryContext, Segment, parse_options

_CHUNK_OVERHEAD = 64  # bytes of bookkeeping per chunk beyond its vector and text


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
    """Chunk metadata in parallel lists; row i matches row i of the vectors."""

    document_ids: list[str]
    spans: list[tuple[int, int]]
    texts: list[str]
    tokens: list[int]
    text_bytes: int = 0  # UTF-8 bytes of `texts`, kept as chunks are added: stats run on every scrape

    @classmethod
    def empty(cls) -> _Chunks:
        return cls([], [], [], [])

    def append(self, document_id: str, span: tuple[int, int], text: str, tokens: int) -> None:
        self.document_ids.append(document_id)
        self.spans.append(span)
        self.texts.append(text)
        self.tokens.append(tokens)
        self.text_bytes += len(text.encode())

    def extend(self, other: _Chunks) -> None:
        self.document_ids += other.document_ids
        self.spans += other.spans
        self.texts += other.texts
        self.tokens += other.tokens
        self.text_bytes += other.text_bytes


class TextMemory(Memory):
    kind = "text"

    def __init__(self, context: MemoryContext, options: dict[str, Any]) -> None:
        self.options: TextOptions = parse_options(TextOptions, options)
        if context.embedder is None:
            raise ValueError("text memory needs an embedder")
        self._embedder: Embedder = context.embedder
        self._index = faiss.IndexFlatIP(self._embedder.dim)
        self._chunks = _Chunks.empty()  # row i of the index is chunk i; vectors live in the index only
        self._doc_ids: list[str] = []
        self._staged: tuple[str, str, _Chunks, list[np.ndarray]] | None = None

    def begin_document(self, document_id: str, text: str) -> None:
        self._staged = (document_id, text, _Chunks.empty(), [])

    def add_segment(self, segment: Segment) -> None:
        assert self._staged is not None, "begin_document first"
        _, text, chunks, vectors = self._staged
        new = _Chunks.empty()
        step = self.options.chunk_tokens
        for start in range(0, len(segment.token_ids), step):
            spans = segment.token_spans[start : start + step]
            char_start, char_end = spans[0][0], spans[-1][1]
            new.append(segment.document_id, (char_start, char_end), text[char_start:char_end], len(spans))
        if len(self._chunks.texts) + len(chunks.texts) + len(new.texts) > self.options.max_chunks:
            raise BudgetExceededError(f"text memory holds at most {self.options.max_chunks} chunks")
        vectors.append(self._embedder.encode(new.texts))
        chunks.extend(new)

    def _bytes(self, chunks: _Chunks) -> int:
        return len(chunks.texts) * (4 * self._embedder.dim + _CHUNK_OVERHEAD) + chunks.text_bytes

    def staged_bytes(self) -> int:
        return 0 if self._staged is None else self._bytes(self._staged[2])

    def commit_document(self) -> None:
        assert self._staged is not None, "begin_document first"
        document_id, _, chunks, vectors = self._staged
        if vectors:
            self._index.add(np.concatenate(vectors))
            self._chunks.extend(chunks)
        self._doc_ids.append(document_id)
        self._staged = None

    def abort_document(self) -> None:
        self._staged = None

    def estimate_bytes(self, chars: int, tokens: int) -> int:
        n_chunks = -(-tokens // self.options.chunk_tokens) + 1
        return n_chunks * (4 * self._embedder.dim + _CHUNK_OVERHEAD) + 4 * chars  # 4 bytes/char worst case

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
                budget -= self._chunks.tokens[row]
        chosen.sort()  # document order reads better than score order
        return [self._piece(row, score) for row, score in chosen]

    def _piece(self, row: int, score: float) -> ContextPiece:
        start, end = self._chunks.spans[row]
        item = RetrievedItem(
            chunk_id=row, document_id=self._chunks.document_ids[row], char_start=start, char_end=end, score=score
        )
        return ContextPiece(self._chunks.texts[row], item)

    def stats(self) -> CacheInfo:
        return CacheInfo(
            memory=self.kind,
            entries=int(self._index.ntotal),
            bytes=self._bytes(self._chunks),
            capacity=self.options.max_chunks,
            documents=len(self._doc_ids),
        )

    def reset(self) -> None:
        self._index.reset()
        self._chunks = _Chunks.empty()
        self._doc_ids, self._staged = [], None

    def state_dict(self) -> dict[str, Any]:
        return {
            "documents": list(self._doc_ids),
            "vectors": self._index.reconstruct_n(0, self._index.ntotal),
            "chunk_documents": list(self._chunks.document_ids),
            "chunk_spans": np.asarray(self._chunks.spans, np.int64).reshape(-1, 2),
            "chunk_texts": list(self._chunks.texts),
            "chunk_tokens": np.asarray(self._chunks.tokens, np.int64),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset()
        self._doc_ids = list(state["documents"])
        vectors = np.ascontiguousarray(state["vectors"], np.float32).reshape(-1, self._embedder.dim)
        self._chunks = _Chunks(
            document_ids=list(state["chunk_documents"]),
            spans=[(int(a), int(b)) for a, b in np.asarray(state["chunk_spans"]).reshape(-1, 2)],
            texts=list(state["chunk_texts"]),
            tokens=[int(t) for t in state["chunk_tokens"]],
            text_bytes=sum(len(t.encode()) for t in state["chunk_texts"]),
        )
        self._index.add(vectors)
