"""What the `text` memory holds: its documents, their chunks as character spans, the chunks' MiniLM
vectors (a FAISS inner-product index), their BM25 terms and, where kept, their sentences' vectors.

A document is staged segment by segment (`begin`, `add_segment`) and becomes visible at `commit`,
which builds the new BM25 index first, so a failure there changes nothing; `abort` drops it.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import faiss
import numpy as np
import torch

from engine.errors import BudgetExceededError
from engine.memories.base import Segment
from engine.memories.text.lexical import LexicalIndex
from engine.memories.text.options import TextOptions
from engine.models.embedder import BASE_NAME, Embedder

_CHUNK_BYTES = 2 * 8 + 4 + 4  # a chunk's span (two int64), token count and document number (int32)
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+|\n\s*\n")
MAX_SENTENCES = 16  # a chunk's sentences beyond this many are grouped, so its bytes have a bound
_COSINE_ROWS = 8_192  # sentence vectors made float32 at a time for a question's cosines (12 MB at 384 dims)


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


def sentence_start(text: str, start: int, *, reach: int, low: int) -> int:
    """Where the sentence holding text[start] begins, when that is at most `reach` characters back
    and not before `low` (the end of the excerpt before; 0 when there is none, and then the text's
    own start counts as a boundary); else `start`. Whitespace at `start` is stepped over first: a
    token's span holds its leading space, so a chunk that starts a sentence starts on the space."""
    first = start
    while first < min(len(text), start + reach) and text[first].isspace():
        first += 1
    ends = list(_SENTENCE_END.finditer(text, max(low, first - reach), first))
    if ends:
        return ends[-1].end()
    return 0 if low == 0 and first <= reach else start


def sentence_end(text: str, end: int, *, reach: int, high: int) -> int:
    """Where the sentence holding text[end - 1] ends, closing quotes and brackets included, when
    that is at most `reach` characters on and not past `high` (the start of the excerpt after, or
    the text's length, whose end then counts as a boundary); else `end`. Whitespace before `end` is
    stepped back over first, so a chunk that ends a sentence with its line break stays as it is."""
    last = end
    while last > max(0, end - reach) and text[last - 1].isspace():
        last -= 1
    after = _SENTENCE_END.search(text, last, min(high, end + reach))
    if after is not None:
        return max(end, after.start() + len(after.group().rstrip()))
    return len(text) if high == len(text) and len(text) - end <= reach else end


def chunk_sentences(text: str, limit: int = MAX_SENTENCES) -> list[tuple[int, int]]:
    """(start, end) of a chunk's sentences; past `limit` sentences, runs of neighbours are grouped."""
    spans = _sentences(text)
    if len(spans) <= limit:
        return spans
    bounds = np.linspace(0, len(spans), limit + 1).round().astype(int).tolist()
    return [(spans[a][0], spans[b - 1][1]) for a, b in pairwise(bounds)]


@dataclass
class Chunks:
    """Chunks as arrays: chunk i is row i of the index, and its text is characters
    spans[i] of document documents[i]. Texts are never copied out of their document."""

    documents: np.ndarray  # int32 [n]: position in TextStore.documents
    spans: np.ndarray  # int64 [n, 2]
    tokens: np.ndarray  # int32 [n]

    @classmethod
    def of(cls, documents: list[int], spans: list[tuple[int, int]], tokens: list[int]) -> Chunks:
        return cls(np.asarray(documents, np.int32), np.asarray(spans, np.int64).reshape(-1, 2), np.asarray(tokens, np.int32))

    @classmethod
    def empty(cls) -> Chunks:
        return cls.of([], [], [])

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, other: Chunks) -> Chunks:
        return Chunks(
            np.concatenate([self.documents, other.documents]),
            np.concatenate([self.spans, other.spans]),
            np.concatenate([self.tokens, other.tokens]),
        )


@dataclass
class Sentences:
    """The chunks' sentences (where `TextOptions.keeps_sentences`): chunk i's are rows starts[i]:starts[i + 1],
    each a character span of the chunk's document and a float16 vector."""

    starts: np.ndarray  # int64 [chunks + 1]
    spans: np.ndarray  # int64 [m, 2]
    vectors: np.ndarray  # float16 [m, dim]

    @classmethod
    def of(cls, counts: list[int], spans: list[tuple[int, int]], vectors: list[np.ndarray], dim: int) -> Sentences:
        starts = np.concatenate([[0], np.cumsum(np.asarray(counts, np.int64))]).astype(np.int64)
        matrix = np.concatenate(vectors).astype(np.float16) if vectors else np.zeros((0, dim), np.float16)
        return cls(starts, np.asarray(spans, np.int64).reshape(-1, 2), matrix.reshape(-1, dim))

    def extend(self, other: Sentences) -> Sentences:
        starts = np.concatenate([self.starts, other.starts[1:] + self.starts[-1]])
        return Sentences(starts, np.concatenate([self.spans, other.spans]), np.concatenate([self.vectors, other.vectors]))

    @property
    def nbytes(self) -> int:
        return self.starts.nbytes + self.spans.nbytes + self.vectors.nbytes

    def cosines(self, query_vector: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """float32: every sentence's (or `rows`') cosine with the question; 0 for a zero row (a
        sentence that held no token of its chunk's MiniLM pass). In blocks of _COSINE_ROWS, so a
        question copies at most that many float16 rows to float32 at a time."""
        vectors = self.vectors if rows is None else self.vectors[rows]
        query = torch.from_numpy(query_vector)
        blocks = [
            (torch.from_numpy(vectors[i : i + _COSINE_ROWS]).float() @ query).numpy()
            for i in range(0, len(vectors), _COSINE_ROWS)
        ]
        return np.concatenate(blocks) if blocks else np.zeros(0, np.float32)

    @staticmethod
    def bytes_per_chunk(dim: int) -> int:
        return 8 + MAX_SENTENCES * (16 + 2 * dim)


@dataclass
class Staged:
    document_id: str
    text: str
    spans: list[tuple[int, int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    vectors: list[np.ndarray] = field(default_factory=list)
    sentence_counts: list[int] = field(default_factory=list)
    sentence_spans: list[tuple[int, int]] = field(default_factory=list)
    sentence_vectors: list[np.ndarray] = field(default_factory=list)


class TextStore:
    """The documents, chunks, vectors, BM25 terms and sentences of one `text` memory (or of a
    `kvcache` memory's text index). `options` is read at each use: a session loaded from disk may
    replace it before `load_state_dict`."""

    def __init__(self, embedder: Embedder, options: TextOptions) -> None:
        self.embedder, self.options = embedder, options
        self.index = faiss.IndexFlatIP(embedder.dim)  # the chunks' vectors live here only
        self.lexical = LexicalIndex()
        self.chunks = Chunks.empty()
        self.sentences = self.no_sentences()
        self.documents: list[tuple[str, str]] = []  # (id, text) of each committed document
        self.text_bytes = 0  # their texts' size in RAM: kept, as stats run on every budget check and scrape
        self.staged: Staged | None = None

    def begin(self, document_id: str, text: str) -> None:
        self.staged = Staged(document_id, text)

    def add_segment(self, segment: Segment) -> None:
        assert self.staged is not None, "begin first"
        staged, step = self.staged, self.options.chunk_tokens
        pieces = [segment.token_spans[start : start + step] for start in range(0, len(segment.token_ids), step)]
        if len(self.chunks) + len(staged.spans) + len(pieces) > self.options.max_chunks:
            raise BudgetExceededError(f"text memory holds at most {self.options.max_chunks} chunks")
        spans = [(piece[0][0], piece[-1][1]) for piece in pieces]
        self._embed(staged, spans)
        staged.spans += spans
        staged.tokens += [len(piece) for piece in pieces]

    def _embed(self, staged: Staged, spans: list[tuple[int, int]]) -> None:
        """The chunks' vectors into `staged`, and where kept their sentences' from the same pass."""
        texts = [staged.text[a:b] for a, b in spans]
        keeps = self.options.keeps_sentences()
        parts = [chunk_sentences(text) if keeps else [] for text in texts]
        vectors, part_vectors = self.embedder.encode_parts(texts, parts)
        staged.vectors.append(vectors)
        if keeps:
            staged.sentence_counts += [len(p) for p in parts]
            staged.sentence_spans += [(a + s, a + e) for (a, _), p in zip(spans, parts, strict=True) for s, e in p]
            staged.sentence_vectors += part_vectors

    def no_sentences(self) -> Sentences:
        return Sentences.of([], [], [], self.embedder.dim)

    def _chunk_bytes(self) -> int:
        """Upper estimate per chunk: its vector, span and count, its BM25 terms, and its sentences where kept."""
        sentences = Sentences.bytes_per_chunk(self.embedder.dim) if self.options.keeps_sentences() else 0
        return 4 * self.embedder.dim + _CHUNK_BYTES + LexicalIndex.bytes_per_chunk(self.options.chunk_tokens) + sentences

    def _rebuild_bytes(self, new_chunks: int, new_text_bytes: int) -> int:
        """What rebuilding BM25 at the commit holds for a moment beside the old index: a copy of
        every chunk's text and bm25s's token lists (an estimate of 16 bytes a token)."""
        chunks = len(self.chunks) + new_chunks
        return self.text_bytes + new_text_bytes + 16 * self.options.chunk_tokens * chunks

    def staged_bytes(self) -> int:
        if self.staged is None:
            return 0
        text_bytes = sys.getsizeof(self.staged.text)
        return len(self.staged.spans) * self._chunk_bytes() + text_bytes + self._rebuild_bytes(len(self.staged.spans), text_bytes)

    def commit(self) -> None:
        assert self.staged is not None, "begin first"
        staged = self.staged
        lexical = self.lexical.build(
            self.chunk_texts() + [staged.text[a:b] for a, b in staged.spans]
        )  # may fail: nothing changed yet
        if staged.vectors:
            self.index.add(np.concatenate(staged.vectors))
            number = len(self.documents)
            self.chunks = self.chunks.extend(Chunks.of([number] * len(staged.spans), staged.spans, staged.tokens))
            if self.options.keeps_sentences():
                added = Sentences.of(staged.sentence_counts, staged.sentence_spans, staged.sentence_vectors, self.embedder.dim)
                self.sentences = self.sentences.extend(added)
        self.documents.append((staged.document_id, staged.text))
        self.text_bytes += sys.getsizeof(staged.text)
        self.staged, self.lexical = None, lexical

    def abort(self) -> None:
        self.staged = None

    def numbers(self) -> dict[str, int]:
        """Each committed document's position among them (what `Chunks.documents` holds), by its id."""
        return {document_id: number for number, (document_id, _) in enumerate(self.documents)}

    def chunk_texts(self, rows: list[int] | None = None) -> list[str]:
        """The texts of chunks `rows` (every chunk's by default)."""
        chosen: slice | list[int] = slice(None) if rows is None else rows
        texts = [text for _, text in self.documents]
        documents, spans = self.chunks.documents[chosen].tolist(), self.chunks.spans[chosen].tolist()
        return [texts[d][a:b] for d, (a, b) in zip(documents, spans, strict=True)]

    def estimate_bytes(self, chars: int, tokens: int) -> int:
        n_chunks = -(-tokens // self.options.chunk_tokens) + 1
        text_bytes = 4 * chars + 80  # 4 bytes a character at worst
        return n_chunks * self._chunk_bytes() + text_bytes + self._rebuild_bytes(n_chunks, text_bytes)

    @property
    def nbytes(self) -> int:
        """What the committed documents hold: vectors, spans and counts, BM25, texts and sentences."""
        return (
            len(self.chunks) * (4 * self.embedder.dim + _CHUNK_BYTES)
            + self.lexical.nbytes
            + self.text_bytes
            + self.sentences.nbytes
        )

    def reset(self) -> None:
        self.index.reset()
        self.lexical = LexicalIndex()
        self.chunks = Chunks.empty()
        self.sentences = self.no_sentences()
        self.documents, self.staged, self.text_bytes = [], None, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "embedder": self.embedder.name,
            "documents": [document_id for document_id, _ in self.documents],
            "document_texts": [text for _, text in self.documents],
            "vectors": self.index.reconstruct_n(0, self.index.ntotal),
            "chunk_documents": self.chunks.documents.copy(),
            "chunk_spans": self.chunks.spans.copy(),
            "chunk_tokens": self.chunks.tokens.copy(),
            "sentence_starts": self.sentences.starts.copy(),
            "sentence_spans": self.sentences.spans.copy(),
            "sentence_vectors": self.sentences.vectors.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Read a saved store back; True when its vectors had to be made again (saved by a server
        with another embedder or adapter, whose vectors do not match this one's questions)."""
        self.reset()
        self.documents = list(zip(state["documents"], state["document_texts"], strict=True))
        self.text_bytes = sum(sys.getsizeof(text) for _, text in self.documents)
        self.chunks = Chunks.of(state["chunk_documents"], state["chunk_spans"], state["chunk_tokens"])
        self.lexical = self.lexical.build(self.chunk_texts())
        if state.get("embedder", BASE_NAME) != self.embedder.name:
            self._embed_again()
            return True
        self.index.add(np.ascontiguousarray(state["vectors"], np.float32).reshape(-1, self.embedder.dim))
        if self.options.keeps_sentences():
            self.sentences = self._loaded_sentences(state)
        return False

    def _loaded_sentences(self, state: dict[str, Any]) -> Sentences:
        """The saved sentences, or, from a session saved without them, the chunks embedded again."""
        if len(state.get("sentence_starts", ())) == len(self.chunks) + 1:
            vectors = np.asarray(state["sentence_vectors"], np.float16).reshape(-1, self.embedder.dim)
            return Sentences(
                np.asarray(state["sentence_starts"], np.int64), np.asarray(state["sentence_spans"], np.int64), vectors
            )
        return self._embedded()[1]

    def _embed_again(self) -> None:
        """The chunks' vectors (and where kept their sentences') made again from their texts."""
        vectors, sentences = self._embedded()
        self.index.reset()
        self.index.add(vectors)
        if self.options.keeps_sentences():
            self.sentences = sentences

    def _embedded(self) -> tuple[np.ndarray, Sentences]:
        """Every chunk's vector and, where kept, its sentences', in one MiniLM pass a chunk."""
        vectors, sentences = [], self.no_sentences()
        for number, (document_id, text) in enumerate(self.documents):
            staged = Staged(document_id, text)
            self._embed(staged, [(a, b) for a, b in self.chunks.spans[self.chunks.documents == number].tolist()])
            vectors += staged.vectors
            sentences = sentences.extend(
                Sentences.of(staged.sentence_counts, staged.sentence_spans, staged.sentence_vectors, self.embedder.dim)
            )
        matrix = np.concatenate(vectors) if vectors else np.zeros((0, self.embedder.dim), np.float32)
        return matrix, sentences
