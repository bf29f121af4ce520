"""Text retrieval: a session's documents cut into chunks, found by meaning and by words.

Each chunk has a MiniLM vector (a per-session FAISS inner-product index) and BM25 terms
(engine/memories/lexical.py). A question ranks the chunks both ways; the two rankings are fused by
reciprocal rank fusion (score = sum of 1 / (rrf_k + rank)), the prompt is filled in fused order up
to `context_tokens`, chunks that touch are merged, and the excerpts are placed in document order.
Ties break by chunk number, so the same documents and question always give the same excerpts.
With `focus_tokens`, the chosen chunks are cut down to their sentences closest to the question.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import faiss
import numpy as np

from engine.embedder import Embedder
from engine.errors import BudgetExceededError
from engine.interface import CacheInfo, RetrievedItem
from engine.memories.base import ContextPiece, Memory, MemoryContext, Segment, parse_options
from engine.memories.lexical import LexicalIndex

_CHUNK_BYTES = 2 * 8 + 4 + 4  # a chunk's span (two int64), token count and document number (int32)


RETRIEVALS = ("hybrid", "dense", "lexical")
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+|\n\s*\n")
_CHARS_PER_TOKEN = 4
_MIN_SENTENCE_CHARS = 40


def _sentences(text: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence of `text` (ends of sentences and blank lines split it)."""
    spans, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        if text[start : match.start()].strip():
            spans.append((start, match.start()))
        start = match.end()
    if text[start:].strip():
        spans.append((start, len(text)))
    return spans


@dataclass(frozen=True)
class TextOptions:
    chunk_tokens: int = 128
    top_k: int = 4  # at most this many chunks
    context_tokens: int = 512  # and at most this many tokens of them (needles: docs/benchmarks.md)
    retrieval: str = "hybrid"
    rrf_k: int = 60
    max_chunks: int = 200_000
    focus_tokens: int = 0  # > 0: of the chosen chunks, keep only their best sentences, this many tokens

    def __post_init__(self) -> None:
        if not 16 <= self.chunk_tokens <= 512:
            raise ValueError("chunk_tokens must be between 16 and 512")
        if not 1 <= self.top_k <= 64:
            raise ValueError("top_k must be between 1 and 64")
        if not self.chunk_tokens <= self.context_tokens <= 32_768:
            raise ValueError("context_tokens must be between chunk_tokens and 32768")
        if self.retrieval not in RETRIEVALS:
            raise ValueError(f"retrieval must be one of {list(RETRIEVALS)}")
        if not 1 <= self.rrf_k <= 1000:
            raise ValueError("rrf_k must be between 1 and 1000")
        if self.max_chunks < 1:
            raise ValueError("max_chunks must be positive")
        if not 0 <= self.focus_tokens <= self.context_tokens:
            raise ValueError("focus_tokens must be between 0 and context_tokens")


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
        self._lexical = LexicalIndex()
        self._chunks = _Chunks.empty()
        self._documents: list[tuple[str, str]] = []  # (id, text) of each committed document
        self._text_bytes = 0  # their texts' size in RAM: kept, as stats run on every budget check and scrape
        self._staged: _Staged | None = None

    def begin_document(self, document_id: str, text: str, tokens: int) -> None:
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

    def _chunk_bytes(self) -> int:
        """Upper estimate per chunk: its vector, span and count, and its BM25 terms."""
        return 4 * self._embedder.dim + _CHUNK_BYTES + LexicalIndex.bytes_per_chunk(self.options.chunk_tokens)

    def _rebuild_bytes(self, new_chunks: int, new_text_bytes: int) -> int:
        """What rebuilding BM25 at the commit holds for a moment beside the old index: a copy of
        every chunk's text and bm25s's token lists (an estimate of 16 bytes a token)."""
        chunks = len(self._chunks) + new_chunks
        return self._text_bytes + new_text_bytes + 16 * self.options.chunk_tokens * chunks

    def staged_bytes(self) -> int:
        if self._staged is None:
            return 0
        text_bytes = sys.getsizeof(self._staged.text)
        return (
            len(self._staged.spans) * self._chunk_bytes() + text_bytes + self._rebuild_bytes(len(self._staged.spans), text_bytes)
        )

    def commit_document(self) -> None:
        assert self._staged is not None, "begin_document first"
        staged = self._staged
        lexical = self._lexical.build(
            self._chunk_texts() + [staged.text[a:b] for a, b in staged.spans]
        )  # may fail: nothing changed yet
        if staged.vectors:
            self._index.add(np.concatenate(staged.vectors))
            number = len(self._documents)
            self._chunks = self._chunks.extend(_Chunks.of([number] * len(staged.spans), staged.spans, staged.tokens))
        self._documents.append((staged.document_id, staged.text))
        self._text_bytes += sys.getsizeof(staged.text)
        self._staged, self._lexical = None, lexical

    def _chunk_texts(self) -> list[str]:
        texts = [text for _, text in self._documents]
        return [texts[d][a:b] for d, (a, b) in zip(self._chunks.documents.tolist(), self._chunks.spans.tolist(), strict=True)]

    def abort_document(self) -> None:
        self._staged = None

    def estimate_bytes(self, chars: int, tokens: int) -> int:
        n_chunks = -(-tokens // self.options.chunk_tokens) + 1
        text_bytes = 4 * chars + 80  # 4 bytes a character at worst
        return n_chunks * self._chunk_bytes() + text_bytes + self._rebuild_bytes(n_chunks, text_bytes)

    def retrieve(self, query: str, max_tokens: int) -> list[ContextPiece]:
        if self._index.ntotal == 0:
            return []
        dense = self.options.retrieval != "lexical" or self.options.focus_tokens > 0
        query_vector = self._embedder.encode([query])[0] if dense else None  # one MiniLM pass a question
        pieces = self._retrieve_chunks(query, query_vector, max_tokens)
        if self.options.focus_tokens:
            assert query_vector is not None
            return self._focus(query_vector, pieces, min(max_tokens, self.options.focus_tokens))
        return pieces

    def _focus(self, query_vector: np.ndarray, pieces: list[ContextPiece], budget: int) -> list[ContextPiece]:
        """The sentences of `pieces` closest to the question (MiniLM), each with the one after it,
        up to `budget` tokens (estimated from characters); sentences that touch are one excerpt,
        in document order. Costs one MiniLM pass over the chosen chunks' sentences."""
        sentences = [(k, a, b) for k, piece in enumerate(pieces) for a, b in _sentences(piece.text)]
        if not sentences:
            return pieces
        vectors = self._embedder.encode([pieces[k].text[a:b] for k, a, b in sentences])
        similarity = vectors @ query_vector
        chosen: set[int] = set()
        left = budget * _CHARS_PER_TOKEN
        for best in np.argsort(-similarity, kind="stable").tolist():
            for j in (best, best + 1):  # the answer often follows the sentence that matches the question
                if j < len(sentences) and j not in chosen and sentences[j][0] == sentences[best][0]:
                    if sentences[j][2] - sentences[j][1] <= left:
                        chosen.add(j)
                        left -= sentences[j][2] - sentences[j][1]
            if left < _MIN_SENTENCE_CHARS:
                break
        runs: list[list[int]] = []
        for j in sorted(chosen):
            if runs and runs[-1][-1] == j - 1 and sentences[j - 1][0] == sentences[j][0]:
                runs[-1].append(j)
            else:
                runs.append([j])
        return [self._sub_piece(pieces, sentences, run, similarity) for run in runs]

    @staticmethod
    def _sub_piece(
        pieces: list[ContextPiece], sentences: list[tuple[int, int, int]], run: list[int], similarity: np.ndarray
    ) -> ContextPiece:
        piece = pieces[sentences[run[0]][0]]
        start, end = sentences[run[0]][1], sentences[run[-1]][2]
        item = piece.item
        score = float(max(similarity[j] for j in run))
        span = dataclasses.replace(item, char_start=item.char_start + start, char_end=item.char_start + end, score=score)
        return ContextPiece(piece.text[start:end], span)

    def _retrieve_chunks(self, query: str, query_vector: np.ndarray | None, max_tokens: int) -> list[ContextPiece]:
        scores = self._ranked(query, query_vector)
        chosen: dict[int, float] = {}
        budget = min(max_tokens, self.options.context_tokens)
        for row, score in scores:
            if len(chosen) == self.options.top_k or budget < 1:
                break
            if self._chunks.tokens[row] <= budget:
                chosen[row] = score
                budget -= int(self._chunks.tokens[row])
        return [self._piece(run, chosen) for run in self._runs(sorted(chosen))]

    def _ranked(self, query: str, query_vector: np.ndarray | None) -> list[tuple[int, float]]:
        """(chunk, score) best first: fused ranks, or one ranking alone (options.retrieval)."""
        n, retrieval = self._index.ntotal, self.options.retrieval
        depth = min(n, max(50, 4 * self.options.top_k))
        rankings: list[list[int]] = []
        if retrieval in ("hybrid", "dense"):
            assert query_vector is not None
            _, rows = self._index.search(query_vector[None], depth)
            rankings.append([r for r in rows[0].tolist() if r >= 0])
        if retrieval in ("hybrid", "lexical"):
            lexical = self._lexical.scores(query)
            order = np.argsort(-lexical, kind="stable")[:depth]
            rankings.append([r for r in order.tolist() if lexical[r] > 0])
        fused: dict[int, float] = {}
        for ranking in rankings:
            for rank, row in enumerate(ranking):
                fused[row] = fused.get(row, 0.0) + 1.0 / (self.options.rrf_k + rank + 1)
        return sorted(fused.items(), key=lambda item: (-item[1], item[0]))

    def _runs(self, rows: list[int]) -> list[list[int]]:
        """Chosen chunks in document order, consecutive chunks of one document as one run."""
        runs: list[list[int]] = []
        for row in rows:
            if runs and row == runs[-1][-1] + 1 and self._chunks.documents[row] == self._chunks.documents[runs[-1][-1]]:
                runs[-1].append(row)
            else:
                runs.append([row])
        return runs

    def _piece(self, run: list[int], scores: dict[int, float]) -> ContextPiece:
        document_id, text = self._documents[self._chunks.documents[run[0]]]
        start, end = int(self._chunks.spans[run[0]][0]), int(self._chunks.spans[run[-1]][1])
        score = max(scores[row] for row in run)
        item = RetrievedItem(chunk_id=run[0], document_id=document_id, char_start=start, char_end=end, score=score)
        return ContextPiece(text[start:end], item)

    def stats(self) -> CacheInfo:
        return CacheInfo(
            memory=self.kind,
            entries=int(self._index.ntotal),
            bytes=len(self._chunks) * (4 * self._embedder.dim + _CHUNK_BYTES) + self._lexical.nbytes + self._text_bytes,
            capacity=self.options.max_chunks,
            documents=len(self._documents),
        )

    def reset(self) -> None:
        self._index.reset()
        self._lexical = LexicalIndex()
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
        self._lexical = self._lexical.build(self._chunk_texts())
