"""Text retrieval: a session's documents cut into chunks, found by meaning and by words.

Each chunk has a MiniLM vector (a per-session FAISS inner-product index) and BM25 terms
(engine/memories/text/lexical.py). A question scores every chunk both ways; the two scores are fused
(`fusion`): by default each is standardized over the session's chunks (z-scores) and they are
summed with weights `dense_weight` and 1 - `dense_weight`. With `sentence_share`, MiniLM's part is
itself a weighted sum of two z-scores: the chunk's vector's similarity and its best sentence's
(sentence vectors pooled from the chunk's own pass at ingestion), so a question that matches one
sentence is not drowned by the rest of its chunk. "rank" fuses the two rankings instead
(reciprocal rank fusion, score = sum of 1 / (rrf_k + rank)). The prompt is filled in fused order up
to `context_tokens`, chunks that touch are merged, and the excerpts are placed in document order.
Ties break by chunk number, so the same documents and question always give the same excerpts.
With `focus_tokens`, the chosen chunks are cut down to their sentences closest to the question:
each chunk's sentences get MiniLM vectors at ingestion, pooled from the chunk's own pass, so a
question costs no more MiniLM work than its own vector.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import faiss
import numpy as np
import torch

from engine.errors import BudgetExceededError
from engine.interface import CacheInfo, RetrievedItem
from engine.memories.base import ContextPiece, Memory, MemoryContext, Segment
from engine.memories.text.lexical import LexicalIndex
from engine.memories.text.rerank import QUESTION_TOKENS, frame_tokens, pass_bytes, question_ids, question_likelihood
from engine.models.embedder import BASE_NAME, Embedder

_CHUNK_BYTES = 2 * 8 + 4 + 4  # a chunk's span (two int64), token count and document number (int32)


RETRIEVALS = ("hybrid", "dense", "lexical")
FUSIONS = ("score", "rank")
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+|\n\s*\n")
_CHARS_PER_TOKEN = 4
_MIN_SENTENCE_CHARS = 40
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


def _standardized(scores: np.ndarray) -> np.ndarray:
    """Scores as z-scores over their own set (all zero where they are all equal)."""
    spread = float(scores.std())
    return (scores - scores.mean()) / spread if spread > 0 else np.zeros_like(scores)


def _runs(items: list[int], joins: Callable[[int, int], bool]) -> list[list[int]]:
    """Sorted `items` cut into runs: each item joins the run before it when `joins(last, item)`."""
    runs: list[list[int]] = []
    for item in items:
        if runs and joins(runs[-1][-1], item):
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


@dataclass(frozen=True)
class TextOptions:
    chunk_tokens: int = 128
    top_k: int = 4  # at most this many chunks
    context_tokens: int = 512  # and at most this many tokens of them (needles: docs/studies/retrieval.md)
    retrieval: str = "hybrid"
    fusion: str = "score"  # hybrid: "score" (weighted z-scores) or "rank" (reciprocal rank fusion)
    dense_weight: float = 0.3  # score fusion: MiniLM's weight, BM25's is 1 - this (docs/studies/retrieval.md#score-fusion)
    rrf_k: int = 60  # rank fusion
    max_chunks: int = 200_000
    focus_tokens: int = 0  # > 0: of the chosen chunks, only their best sentences, this many tokens; 0: whole chunks
    rerank: int = 0  # > 0: the chunks are chosen from this many best fused ones, reordered by the reader
    sentence_tokens: int = 50  # whole chunks: at most about this many tokens added at each end, to whole sentences
    margin: float = 0.0  # > 0: a chunk is taken only when its fused score is within this of the first taken's
    sentence_share: float = 0.0  # score fusion: of MiniLM's weight, the share of each chunk's best sentence's similarity

    def __post_init__(self) -> None:
        if not 16 <= self.chunk_tokens <= 512:
            raise ValueError("chunk_tokens must be between 16 and 512")
        if not 1 <= self.top_k <= 64:
            raise ValueError("top_k must be between 1 and 64")
        if not self.chunk_tokens <= self.context_tokens <= 32_768:
            raise ValueError("context_tokens must be between chunk_tokens and 32768")
        if self.retrieval not in RETRIEVALS:
            raise ValueError(f"retrieval must be one of {list(RETRIEVALS)}")
        if self.fusion not in FUSIONS:
            raise ValueError(f"fusion must be one of {list(FUSIONS)}")
        if not 0.0 <= self.dense_weight <= 1.0:
            raise ValueError("dense_weight must be between 0 and 1")
        if not 1 <= self.rrf_k <= 1000:
            raise ValueError("rrf_k must be between 1 and 1000")
        if self.max_chunks < 1:
            raise ValueError("max_chunks must be positive")
        if self.rerank and not self.top_k <= self.rerank <= 64:
            raise ValueError(f"rerank must be 0 (off) or between top_k ({self.top_k}) and 64")
        if not 0 <= self.focus_tokens <= 32_768:
            raise ValueError("focus_tokens must be between 0 and 32768 (0: whole chunks)")
        if not 0 <= self.sentence_tokens <= 512:
            raise ValueError("sentence_tokens must be between 0 and 512 (0: excerpts end where their chunks do)")
        if not 0.0 <= self.margin <= 100.0:
            raise ValueError("margin must be between 0 (off) and 100")
        if not 0.0 <= self.sentence_share <= 1.0:
            raise ValueError("sentence_share must be between 0 and 1")

    def score_fusion(self) -> bool:
        return (self.retrieval, self.fusion) == ("hybrid", "score")

    def keeps_sentences(self) -> bool:
        """Whether each chunk's sentences get vectors at ingestion: for `focus_tokens`, or for
        `sentence_share` where it applies (score fusion)."""
        return self.focus_tokens > 0 or (self.sentence_share > 0 and self.score_fusion())

    def score_margin(self) -> float:
        """`margin` where scores are fused z-scores (hybrid, score fusion, no rerank); 0 elsewhere,
        where it would be in other units. Not refused there: a model's manifest may set a margin
        that a session choosing rank fusion or rerank inherits."""
        return self.margin if self.score_fusion() and not self.rerank else 0.0


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
class _Sentences:
    """The chunks' sentences (where `TextOptions.keeps_sentences`): chunk i's are rows starts[i]:starts[i + 1],
    each a character span of the chunk's document and a float16 vector."""

    starts: np.ndarray  # int64 [chunks + 1]
    spans: np.ndarray  # int64 [m, 2]
    vectors: np.ndarray  # float16 [m, dim]

    @classmethod
    def of(cls, counts: list[int], spans: list[tuple[int, int]], vectors: list[np.ndarray], dim: int) -> _Sentences:
        starts = np.concatenate([[0], np.cumsum(np.asarray(counts, np.int64))]).astype(np.int64)
        matrix = np.concatenate(vectors).astype(np.float16) if vectors else np.zeros((0, dim), np.float16)
        return cls(starts, np.asarray(spans, np.int64).reshape(-1, 2), matrix.reshape(-1, dim))

    def extend(self, other: _Sentences) -> _Sentences:
        starts = np.concatenate([self.starts, other.starts[1:] + self.starts[-1]])
        return _Sentences(starts, np.concatenate([self.spans, other.spans]), np.concatenate([self.vectors, other.vectors]))

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
class _Staged:
    document_id: str
    text: str
    spans: list[tuple[int, int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    vectors: list[np.ndarray] = field(default_factory=list)
    sentence_counts: list[int] = field(default_factory=list)
    sentence_spans: list[tuple[int, int]] = field(default_factory=list)
    sentence_vectors: list[np.ndarray] = field(default_factory=list)


class TextMemory(Memory):
    kind = "text"
    options_type = TextOptions

    def __init__(self, context: MemoryContext, options: dict[str, Any]) -> None:
        self.options: TextOptions = self.read_options(options)
        if context.embedder is None:
            raise ValueError("text memory needs an embedder")
        self._embedder: Embedder = context.embedder
        if self.options.rerank and context.model is None:
            raise ValueError("rerank needs the served language model, which this model does not lend its memories")
        self._model, self._tokenizer = context.model, context.tokenizer
        self._rerank_tokens = (
            self.options.chunk_tokens + frame_tokens(self._tokenizer) + QUESTION_TOKENS if self.options.rerank else 0
        )
        self._index = faiss.IndexFlatIP(self._embedder.dim)  # the chunks' vectors live here only
        self._lexical = LexicalIndex()
        self._chunks = _Chunks.empty()
        self._sentences = self._no_sentences()
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
        self._embed(staged, spans)
        staged.spans += spans
        staged.tokens += [len(piece) for piece in pieces]

    def _embed(self, staged: _Staged, spans: list[tuple[int, int]]) -> None:
        """The chunks' vectors into `staged`, and where kept their sentences' from the same pass."""
        texts = [staged.text[a:b] for a, b in spans]
        keeps = self.options.keeps_sentences()
        parts = [chunk_sentences(text) if keeps else [] for text in texts]
        vectors, part_vectors = self._embedder.encode_parts(texts, parts)
        staged.vectors.append(vectors)
        if keeps:
            staged.sentence_counts += [len(p) for p in parts]
            staged.sentence_spans += [(a + s, a + e) for (a, _), p in zip(spans, parts, strict=True) for s, e in p]
            staged.sentence_vectors += part_vectors

    def _no_sentences(self) -> _Sentences:
        return _Sentences.of([], [], [], self._embedder.dim)

    def _chunk_bytes(self) -> int:
        """Upper estimate per chunk: its vector, span and count, its BM25 terms, and its sentences where kept."""
        sentences = _Sentences.bytes_per_chunk(self._embedder.dim) if self.options.keeps_sentences() else 0
        return 4 * self._embedder.dim + _CHUNK_BYTES + LexicalIndex.bytes_per_chunk(self.options.chunk_tokens) + sentences

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
            if self.options.keeps_sentences():
                added = _Sentences.of(staged.sentence_counts, staged.sentence_spans, staged.sentence_vectors, self._embedder.dim)
                self._sentences = self._sentences.extend(added)
        self._documents.append((staged.document_id, staged.text))
        self._text_bytes += sys.getsizeof(staged.text)
        self._staged, self._lexical = None, lexical

    def _chunk_texts(self, rows: list[int] | None = None) -> list[str]:
        """The texts of chunks `rows` (every chunk's by default)."""
        chosen: slice | list[int] = slice(None) if rows is None else rows
        texts = [text for _, text in self._documents]
        documents, spans = self._chunks.documents[chosen].tolist(), self._chunks.spans[chosen].tolist()
        return [texts[d][a:b] for d, (a, b) in zip(documents, spans, strict=True)]

    def abort_document(self) -> None:
        self._staged = None

    def estimate_bytes(self, chars: int, tokens: int) -> int:
        n_chunks = -(-tokens // self.options.chunk_tokens) + 1
        text_bytes = 4 * chars + 80  # 4 bytes a character at worst
        return n_chunks * self._chunk_bytes() + text_bytes + self._rebuild_bytes(n_chunks, text_bytes)

    def retrieve(self, query: str, max_tokens: int) -> list[ContextPiece]:
        if self._index.ntotal == 0:
            return []
        query_vector = self._query_vector(query)
        chosen = self._chosen_chunks(query, query_vector, max_tokens)
        if self.options.focus_tokens:
            assert query_vector is not None
            return self._focus(query, query_vector, chosen, min(max_tokens, self.options.focus_tokens))
        room = min(max_tokens, self.options.context_tokens) - int(self._chunks.tokens[list(chosen)].sum())
        return self._whole_chunks(chosen, room)

    def _query_vector(self, query: str) -> np.ndarray | None:
        """The question's MiniLM vector (one pass), where retrieval or focus uses one."""
        dense = self.options.retrieval != "lexical" or self.options.focus_tokens > 0
        return self._embedder.encode([query])[0] if dense else None

    def ranked_spans(self, query: str) -> list[tuple[str, int, int, float]]:
        """(document id, start, end, score) of the chunks in the order `retrieve` takes them for
        `query`, before `top_k`, the token budget and `margin` cut it; to measure where a passage
        ranks and how far below the first (`longdoc eval ranks`). Not every chunk: the best
        max(50, 4·top_k) of each ranking (with rank fusion, the union of two; BM25 alone, only
        chunks that hold a word of the question), with `rerank` the first `rerank` in the reader's
        order."""
        if self._index.ntotal == 0:
            return []
        ranked = self._ordered(query, self._query_vector(query))
        rows = [row for row, _ in ranked]
        documents, spans = self._chunks.documents[rows].tolist(), self._chunks.spans[rows].tolist()
        return [(self._documents[d][0], a, b, score) for d, (a, b), (_, score) in zip(documents, spans, ranked, strict=True)]

    def _focus(self, query: str, query_vector: np.ndarray, chosen: dict[int, float], budget: int) -> list[ContextPiece]:
        """The sentences of the chosen chunks closest to the question (their vectors from
        ingestion), each with the one after it, up to `budget` tokens (estimated from characters);
        sentences that touch are one excerpt, in document order."""
        starts = self._sentences.starts
        rows = [r for r in sorted(chosen) if starts[r + 1] > starts[r]]
        if not rows:
            return self._whole_chunks(chosen)
        ids = np.concatenate([np.arange(starts[r], starts[r + 1]) for r in rows])  # document order
        owner = np.concatenate([np.full(starts[r + 1] - starts[r], r) for r in rows])
        similarity = self._sentences.cosines(query_vector, ids)
        lengths = (self._sentences.spans[ids, 1] - self._sentences.spans[ids, 0]).tolist()
        picked: set[int] = set()
        left = budget * _CHARS_PER_TOKEN
        for best in self._sentence_order(query, owner, ids, similarity):
            for j in (best, best + 1):  # the answer often follows the sentence that matches the question
                if j < len(ids) and j not in picked and self._touch(owner, ids, best, j) and lengths[j] <= left:
                    picked.add(j)
                    left -= lengths[j]
            if left < _MIN_SENTENCE_CHARS:
                break
        runs = _runs(sorted(picked), lambda i, j: j == i + 1 and self._touch(owner, ids, i, j))
        return [self._sentence_piece(owner, ids, run, similarity) for run in runs]

    def _sentence_order(self, query: str, owner: np.ndarray, ids: np.ndarray, similarity: np.ndarray) -> list[int]:
        """Candidate sentences best first: MiniLM similarity alone, or in hybrid retrieval fused
        (reciprocal rank) with the IDF of the question's words each sentence holds."""
        dense = np.argsort(-similarity, kind="stable").tolist()
        if self.options.retrieval != "hybrid":
            return dense
        documents = [self._documents[d][1] for d in self._chunks.documents[owner].tolist()]
        texts = [text[a:b] for text, (a, b) in zip(documents, self._sentences.spans[ids].tolist(), strict=True)]
        lexical = self._lexical.term_scores(query, texts)
        words = [j for j in np.argsort(-lexical, kind="stable").tolist() if lexical[j] > 0]
        return [j for j, _ in self._fused([dense, words])]

    def _touch(self, owner: np.ndarray, ids: np.ndarray, i: int, j: int) -> bool:
        """Whether sentence j of the candidates is sentence i itself or the one right after it in its document."""
        if ids[j] - ids[i] not in (0, 1):
            return False
        return bool(self._chunks.documents[owner[i]] == self._chunks.documents[owner[j]])

    def _sentence_piece(self, owner: np.ndarray, ids: np.ndarray, run: list[int], similarity: np.ndarray) -> ContextPiece:
        document_id, text = self._documents[self._chunks.documents[owner[run[0]]]]
        start, end = int(self._sentences.spans[ids[run[0]], 0]), int(self._sentences.spans[ids[run[-1]], 1])
        score = float(max(similarity[j] for j in run))
        item = RetrievedItem(chunk_id=int(owner[run[0]]), document_id=document_id, char_start=start, char_end=end, score=score)
        return ContextPiece(text[start:end], item)

    def _chosen_chunks(self, query: str, query_vector: np.ndarray | None, max_tokens: int) -> dict[int, float]:
        """Chunk -> fused score, best first, within `top_k`, the token budget and `margin` of the
        first chunk taken."""
        chosen: dict[int, float] = {}
        budget = min(max_tokens, self.options.context_tokens)
        margin, floor = self.options.score_margin(), -math.inf  # with a margin, the floor is set by the first chunk taken
        for row, score in self._ordered(query, query_vector):
            if len(chosen) == self.options.top_k or budget < 1 or score < floor:
                break
            if self._chunks.tokens[row] <= budget:
                if margin and not chosen:
                    floor = score - margin
                chosen[row] = score
                budget -= int(self._chunks.tokens[row])
        return chosen

    def _ordered(self, query: str, query_vector: np.ndarray | None) -> list[tuple[int, float]]:
        """(chunk, score) in the order chunks are taken: fused, or with `rerank` the reader's
        order of the first `rerank` (the rest are not taken)."""
        ranked = self._ranked(query, query_vector)
        return self._reranked(query, ranked[: self.options.rerank]) if self.options.rerank else ranked

    def _ranked(self, query: str, query_vector: np.ndarray | None) -> list[tuple[int, float]]:
        """(chunk, score) best first: fused scores or ranks (options.fusion), or one ranking alone (options.retrieval)."""
        n, retrieval = self._index.ntotal, self.options.retrieval
        depth = min(n, max(50, 4 * self.options.top_k))
        if retrieval == "hybrid" and self.options.fusion == "score":
            assert query_vector is not None
            return self._score_fused(query, query_vector, depth)
        rankings: list[list[int]] = []
        if retrieval in ("hybrid", "dense"):
            assert query_vector is not None
            _, rows = self._index.search(query_vector[None], depth)
            rankings.append([r for r in rows[0].tolist() if r >= 0])
        if retrieval in ("hybrid", "lexical"):
            lexical = self._lexical.scores(query)
            order = np.argsort(-lexical, kind="stable")[:depth]
            rankings.append([r for r in order.tolist() if lexical[r] > 0])
        return self._fused(rankings)

    def _score_fused(self, query: str, query_vector: np.ndarray, depth: int) -> list[tuple[int, float]]:
        """(chunk, weighted sum of its standardized MiniLM and BM25 scores), the best `depth`, ties by
        chunk number. Every chunk is scored: the chunks' vectors are read in place, one float a
        chunk each way (with `sentence_share`, the sentences' cosines in blocks)."""
        vectors = faiss.rev_swig_ptr(self._index.get_xb(), self._index.ntotal * self._index.d)  # a view, no copy
        dense = vectors.reshape(self._index.ntotal, self._index.d) @ query_vector
        weight, share = self.options.dense_weight, self.options.sentence_share
        meaning = _standardized(dense)
        if share:
            assert len(self._sentences.starts) == len(dense) + 1, "sentence_share: every chunk's sentences kept"
            meaning = (1.0 - share) * meaning + share * _standardized(self._best_sentences(dense, query_vector))
        fused = weight * meaning + (1.0 - weight) * _standardized(self._lexical.scores(query))
        best = np.argpartition(-fused, depth - 1)[:depth]
        best = best[np.lexsort((best, -fused[best]))]
        return [(int(row), float(fused[row])) for row in best]

    def _best_sentences(self, dense: np.ndarray, query_vector: np.ndarray) -> np.ndarray:
        """Each chunk's best MiniLM similarity of one of its sentences to the question; a chunk
        without sentences (only spaces) or with zero rows only keeps its own (`dense`)."""
        starts = self._sentences.starts
        similarity = self._sentences.cosines(query_vector)
        similarity[similarity == 0.0] = -np.inf  # a zero row (past MiniLM's length) is no sentence's cosine
        held = starts[1:] > starts[:-1]
        best = np.full(len(dense), -np.inf, np.float32)
        best[held] = np.maximum.reduceat(similarity, starts[:-1][held])
        return np.where(np.isfinite(best), best, dense)

    def _reranked(self, query: str, ranked: list[tuple[int, float]]) -> list[tuple[int, float]]:
        """(chunk, the reader's mean log-probability of the question after it) best first, ties by
        chunk number; `ranked` as it is for a question of no tokens."""
        if not question_ids(self._tokenizer, query):
            return ranked
        rows = [row for row, _ in ranked]
        scores = question_likelihood(self._model, self._tokenizer, self._chunk_texts(rows), query)
        return sorted(zip(rows, scores, strict=True), key=lambda pair: (-pair[1], pair[0]))

    def _fused(self, rankings: list[list[int]]) -> list[tuple[int, float]]:
        """Reciprocal rank fusion: (item, sum of 1 / (rrf_k + rank)) best first, ties by item number."""
        fused: dict[int, float] = {}
        for ranking in rankings:
            for rank, item in enumerate(ranking):
                fused[item] = fused.get(item, 0.0) + 1.0 / (self.options.rrf_k + rank + 1)
        return sorted(fused.items(), key=lambda pair: (-pair[1], pair[0]))

    def _whole_chunks(self, chosen: dict[int, float], room: int = 0) -> list[ContextPiece]:
        """The chosen chunks in document order, consecutive chunks of one document as one excerpt;
        with `room` tokens to spare, excerpts widened to whole sentences (`_widened`)."""
        documents, spans = self._chunks.documents, self._chunks.spans
        runs = _runs(sorted(chosen), lambda a, b: b == a + 1 and documents[a] == documents[b])
        excerpts = [(int(documents[run[0]]), int(spans[run[0]][0]), int(spans[run[-1]][1])) for run in runs]
        if self.options.sentence_tokens and room > 0:
            excerpts = self._widened(excerpts, room)
        return [self._piece(run, excerpt, chosen) for run, excerpt in zip(runs, excerpts, strict=True)]

    def _widened(self, excerpts: list[tuple[int, int, int]], room: int) -> list[tuple[int, int, int]]:
        """Excerpts (document, start, end), in document order, each end moved out to the sentence
        boundary within `sentence_tokens` of it while what it adds fits in `room` tokens (the start
        first); an excerpt never grows into the next or the one before. A chunk is cut at a token
        count, often mid-sentence; the reader answers more often from whole sentences
        (docs/studies/retrieval.md#whole-sentences)."""
        reach = self.options.sentence_tokens * _CHARS_PER_TOKEN
        widened: list[tuple[int, int, int]] = []
        for i, (document, start, end) in enumerate(excerpts):
            text = self._documents[document][1]
            low = widened[-1][2] if widened and widened[-1][0] == document else 0
            following = excerpts[i + 1] if i + 1 < len(excerpts) else None
            high = following[1] if following is not None and following[0] == document else len(text)
            first = sentence_start(text, start, reach=reach, low=low)
            if (added := self._token_count(text[first:start])) <= room:
                room, start = room - added, first
            last = sentence_end(text, end, reach=reach, high=high)
            if (added := self._token_count(text[end:last])) <= room:
                room, end = room - added, last
            widened.append((document, start, end))
        return widened

    def _token_count(self, text: str) -> int:
        return len(self._tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0

    def _piece(self, run: list[int], excerpt: tuple[int, int, int], scores: dict[int, float]) -> ContextPiece:
        document, start, end = excerpt
        document_id, text = self._documents[document]
        score = max(scores[row] for row in run)
        item = RetrievedItem(chunk_id=run[0], document_id=document_id, char_start=start, char_end=end, score=score)
        return ContextPiece(text[start:end], item)

    def answer_bytes(self, overhead: int, max_tokens: int, context_len: int, kv_bytes_per_token: int) -> tuple[int, int]:
        """The answer's, or, when larger, the reranking pass's (it ends before the answer starts)."""
        kept, transient = super().answer_bytes(overhead, max_tokens, context_len, kv_bytes_per_token)
        if self.options.rerank:
            element = next(self._model.parameters()).element_size()
            transient = max(transient, pass_bytes(self._model.config, self._rerank_tokens, self.options.rerank, element))
        return kept, transient

    def stats(self) -> CacheInfo:
        return CacheInfo(
            memory=self.kind,
            entries=int(self._index.ntotal),
            bytes=len(self._chunks) * (4 * self._embedder.dim + _CHUNK_BYTES)
            + self._lexical.nbytes
            + self._text_bytes
            + self._sentences.nbytes,
            capacity=self.options.max_chunks,
            documents=len(self._documents),
        )

    def reset(self) -> None:
        self._index.reset()
        self._lexical = LexicalIndex()
        self._chunks = _Chunks.empty()
        self._sentences = self._no_sentences()
        self._documents, self._staged, self._text_bytes = [], None, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "embedder": self._embedder.name,
            "documents": [document_id for document_id, _ in self._documents],
            "document_texts": [text for _, text in self._documents],
            "vectors": self._index.reconstruct_n(0, self._index.ntotal),
            "chunk_documents": self._chunks.documents.copy(),
            "chunk_spans": self._chunks.spans.copy(),
            "chunk_tokens": self._chunks.tokens.copy(),
            "sentence_starts": self._sentences.starts.copy(),
            "sentence_spans": self._sentences.spans.copy(),
            "sentence_vectors": self._sentences.vectors.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset()
        self._documents = list(zip(state["documents"], state["document_texts"], strict=True))
        self._text_bytes = sum(sys.getsizeof(text) for _, text in self._documents)
        self._chunks = _Chunks.of(state["chunk_documents"], state["chunk_spans"], state["chunk_tokens"])
        self._lexical = self._lexical.build(self._chunk_texts())
        if state.get("embedder", BASE_NAME) != self._embedder.name:
            # saved by a server with another embedder (adapter): its vectors do not match this one's questions
            self._embed_again()
            self.remade_on_load = True
            return
        self._index.add(np.ascontiguousarray(state["vectors"], np.float32).reshape(-1, self._embedder.dim))
        if self.options.keeps_sentences():
            self._sentences = self._loaded_sentences(state)

    def _loaded_sentences(self, state: dict[str, Any]) -> _Sentences:
        """The saved sentences, or, from a session saved without them, the chunks embedded again."""
        if len(state.get("sentence_starts", ())) == len(self._chunks) + 1:
            vectors = np.asarray(state["sentence_vectors"], np.float16).reshape(-1, self._embedder.dim)
            return _Sentences(
                np.asarray(state["sentence_starts"], np.int64), np.asarray(state["sentence_spans"], np.int64), vectors
            )
        return self._embedded()[1]

    def _embed_again(self) -> None:
        """The chunks' vectors (and where kept their sentences') made again from their texts."""
        vectors, sentences = self._embedded()
        self._index.reset()
        self._index.add(vectors)
        if self.options.keeps_sentences():
            self._sentences = sentences

    def _embedded(self) -> tuple[np.ndarray, _Sentences]:
        """Every chunk's vector and, where kept, its sentences', in one MiniLM pass a chunk."""
        vectors, sentences = [], self._no_sentences()
        for number, (document_id, text) in enumerate(self._documents):
            staged = _Staged(document_id, text)
            self._embed(staged, [(a, b) for a, b in self._chunks.spans[self._chunks.documents == number].tolist()])
            vectors += staged.vectors
            sentences = sentences.extend(
                _Sentences.of(staged.sentence_counts, staged.sentence_spans, staged.sentence_vectors, self._embedder.dim)
            )
        matrix = np.concatenate(vectors) if vectors else np.zeros((0, self._embedder.dim), np.float32)
        return matrix, sentences
