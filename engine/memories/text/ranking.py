"""How the `text` memory ranks its chunks for a question, and which it takes.

A question scores every chunk by MiniLM and by BM25; the two are fused (`fusion`): by default each
is standardized over the session's chunks (z-scores) and they are summed with weights
`dense_weight` and 1 - `dense_weight`. With `sentence_share`, MiniLM's part is itself a weighted
sum of two z-scores: the chunk's vector's similarity and its best sentence's, so a question that
matches one sentence is not drowned by the rest of its chunk. "rank" fuses the two rankings instead
(reciprocal rank fusion, score = sum of 1 / (rrf_k + rank)). With `rerank`, the reader reorders the
best fused chunks. Ties break by chunk number, so the same documents and question always rank alike.
"""

from __future__ import annotations

import math
from typing import Any

import faiss
import numpy as np
from transformers import PreTrainedTokenizerBase

from engine.memories.text.options import TextOptions
from engine.memories.text.rerank import question_ids, question_likelihood
from engine.memories.text.store import TextStore


def _standardized(scores: np.ndarray) -> np.ndarray:
    """Scores as z-scores over their own set (all zero where they are all equal)."""
    spread = float(scores.std())
    return (scores - scores.mean()) / spread if spread > 0 else np.zeros_like(scores)


class Ranking:
    """Ranks the chunks of `store` for a question; `model` reorders them where `rerank` is set."""

    def __init__(self, store: TextStore, model: Any, tokenizer: PreTrainedTokenizerBase) -> None:
        self.store, self.model, self.tokenizer = store, model, tokenizer

    @property
    def options(self) -> TextOptions:
        return self.store.options

    def query_vector(self, query: str) -> np.ndarray | None:
        """The question's MiniLM vector (one pass), where retrieval or focus uses one."""
        dense = self.options.retrieval != "lexical" or self.options.focus_tokens > 0
        return self.store.embedder.encode([query])[0] if dense else None

    def chosen(
        self,
        query: str,
        query_vector: np.ndarray | None,
        max_tokens: int,
        allowed: np.ndarray | None = None,
        ordered: list[tuple[int, float]] | None = None,
        top_k: int | None = None,
    ) -> dict[int, float]:
        """Chunk -> fused score, best first, within `top_k` (the option's unless given), `max_tokens`
        and `margin` of the first chunk taken; of the `allowed` chunks only (a mask; None:
        all). `ordered`: what `ordered` gives for the same question and chunks, when already computed.
        The caller bounds `max_tokens` (by `context_tokens`: TextMemory._ranked_pieces)."""
        chosen: dict[int, float] = {}
        tokens = self.store.chunks.tokens
        budget = max_tokens
        margin, floor = self.options.score_margin(), -math.inf  # with a margin, the floor is set by the first chunk taken
        for row, score in ordered if ordered is not None else self.ordered(query, query_vector, allowed):
            if len(chosen) == (self.options.top_k if top_k is None else top_k) or budget < 1 or score < floor:
                break
            if tokens[row] <= budget:
                if margin and not chosen:
                    floor = score - margin
                chosen[row] = score
                budget -= int(tokens[row])
        return chosen

    def ordered(self, query: str, query_vector: np.ndarray | None, allowed: np.ndarray | None = None) -> list[tuple[int, float]]:
        """(chunk, score) in the order chunks are taken: fused, or with `rerank` the reader's
        order of the first `rerank` (the rest are not taken)."""
        ranked = self.ranked(query, query_vector, allowed)
        return self._reranked(query, ranked[: self.options.rerank]) if self.options.rerank else ranked

    def ranked(self, query: str, query_vector: np.ndarray | None, allowed: np.ndarray | None = None) -> list[tuple[int, float]]:
        """(chunk, score) best first: fused scores or ranks (options.fusion), or one ranking alone
        (options.retrieval); of the `allowed` chunks only, when given (a mask over the chunks)."""
        index, retrieval = self.store.index, self.options.retrieval
        depth = min(index.ntotal, max(50, 4 * self.options.top_k))
        if retrieval == "hybrid" and self.options.fusion == "score":
            assert query_vector is not None
            return self._score_fused(query, query_vector, depth, allowed)
        cut = depth
        if allowed is not None:
            depth = index.ntotal  # each ranking is kept to the allowed chunks, then cut as without them
        rankings: list[list[int]] = []
        if retrieval in ("hybrid", "dense"):
            assert query_vector is not None
            _, rows = index.search(query_vector[None], depth)
            rankings.append([r for r in rows[0].tolist() if r >= 0])
        if retrieval in ("hybrid", "lexical"):
            lexical = self.store.lexical.scores(query)
            order = np.argsort(-lexical, kind="stable")[:depth]
            rankings.append([r for r in order.tolist() if lexical[r] > 0])
        if allowed is not None:
            rankings = [[r for r in ranking if allowed[r]][:cut] for ranking in rankings]
        return self.fused(rankings)

    def _score_fused(
        self, query: str, query_vector: np.ndarray, depth: int, allowed: np.ndarray | None = None
    ) -> list[tuple[int, float]]:
        """(chunk, weighted sum of its standardized MiniLM and BM25 scores), the best `depth`, ties by
        chunk number. Every chunk is scored: the chunks' vectors are read in place, one float a
        chunk each way (with `sentence_share`, the sentences' cosines in blocks)."""
        index = self.store.index
        vectors = faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d)  # a view, no copy
        dense = vectors.reshape(index.ntotal, index.d) @ query_vector
        weight, share = self.options.dense_weight, self.options.sentence_share
        meaning = _standardized(dense)
        if share:
            assert len(self.store.sentences.starts) == len(dense) + 1, "sentence_share: every chunk's sentences kept"
            meaning = (1.0 - share) * meaning + share * _standardized(self._best_sentences(dense, query_vector))
        fused = weight * meaning + (1.0 - weight) * _standardized(self.store.lexical.scores(query))
        if allowed is not None:  # standardized over the session's chunks as always, then kept to these
            fused = np.where(allowed, fused, -np.inf)
            depth = min(depth, int(allowed.sum()))
        best = np.argpartition(-fused, depth - 1)[:depth]
        best = best[np.lexsort((best, -fused[best]))]
        return [(int(row), float(fused[row])) for row in best]

    def _best_sentences(self, dense: np.ndarray, query_vector: np.ndarray) -> np.ndarray:
        """Each chunk's best MiniLM similarity of one of its sentences to the question; a chunk
        without sentences (only spaces) or with zero rows only keeps its own (`dense`)."""
        sentences = self.store.sentences
        starts = sentences.starts
        similarity = sentences.cosines(query_vector)
        similarity[similarity == 0.0] = -np.inf  # a zero row (past MiniLM's length) is no sentence's cosine
        held = starts[1:] > starts[:-1]
        best = np.full(len(dense), -np.inf, np.float32)
        best[held] = np.maximum.reduceat(similarity, starts[:-1][held])
        return np.where(np.isfinite(best), best, dense)

    def _reranked(self, query: str, ranked: list[tuple[int, float]]) -> list[tuple[int, float]]:
        """(chunk, the reader's mean log-probability of the question after it) best first, ties by
        chunk number; `ranked` as it is for a question of no tokens."""
        if not question_ids(self.tokenizer, query):
            return ranked
        rows = [row for row, _ in ranked]
        scores = question_likelihood(self.model, self.tokenizer, self.store.chunk_texts(rows), query)
        return sorted(zip(rows, scores, strict=True), key=lambda pair: (-pair[1], pair[0]))

    def fused(self, rankings: list[list[int]]) -> list[tuple[int, float]]:
        """Reciprocal rank fusion: (item, sum of 1 / (rrf_k + rank)) best first, ties by item number."""
        fused: dict[int, float] = {}
        for ranking in rankings:
            for rank, item in enumerate(ranking):
                fused[item] = fused.get(item, 0.0) + 1.0 / (self.options.rrf_k + rank + 1)
        return sorted(fused.items(), key=lambda pair: (-pair[1], pair[0]))
