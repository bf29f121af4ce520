"""How the `text` memory cuts the chunks it took into the excerpts the reader sees.

Whole chunks: chunks that touch are one excerpt, placed in document order, widened to whole
sentences while the token budget allows. With `focus_tokens`, only the chosen chunks' sentences
closest to the question (their vectors pooled from each chunk's own MiniLM pass at ingestion, so a
question costs no more MiniLM work than its own vector).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from transformers import PreTrainedTokenizerBase

from engine.interface import RetrievedItem
from engine.memories.base import ContextPiece
from engine.memories.text.gather import Sentence
from engine.memories.text.options import TextOptions
from engine.memories.text.ranking import Ranking
from engine.memories.text.store import TextStore, sentence_end, sentence_start

_CHARS_PER_TOKEN = 4
_MIN_SENTENCE_CHARS = 40


def _runs(items: list[int], joins: Callable[[int, int], bool]) -> list[list[int]]:
    """Sorted `items` cut into runs: each item joins the run before it when `joins(last, item)`."""
    runs: list[list[int]] = []
    for item in items:
        if runs and joins(runs[-1][-1], item):
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


class Excerpts:
    """Cuts chosen chunks of `store` into excerpts (`ranking` orders sentences for `focus`)."""

    def __init__(self, store: TextStore, ranking: Ranking, tokenizer: PreTrainedTokenizerBase) -> None:
        self.store, self.ranking, self.tokenizer = store, ranking, tokenizer

    @property
    def options(self) -> TextOptions:
        return self.store.options

    def focus(self, query: str, query_vector: np.ndarray, chosen: dict[int, float], budget: int) -> list[ContextPiece]:
        """The sentences of the chosen chunks closest to the question (their vectors from
        ingestion), each with the one after it, up to `budget` tokens (estimated from characters);
        sentences that touch are one excerpt, in document order."""
        sentences = self.store.sentences
        starts = sentences.starts
        rows = [r for r in sorted(chosen) if starts[r + 1] > starts[r]]
        if not rows:
            return self.whole_chunks(chosen)
        ids = np.concatenate([np.arange(starts[r], starts[r + 1]) for r in rows])  # document order
        owner = np.concatenate([np.full(starts[r + 1] - starts[r], r) for r in rows])
        similarity = sentences.cosines(query_vector, ids)
        lengths = (sentences.spans[ids, 1] - sentences.spans[ids, 0]).tolist()
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
        store = self.store
        documents = [store.documents[d][1] for d in store.chunks.documents[owner].tolist()]
        texts = [text[a:b] for text, (a, b) in zip(documents, store.sentences.spans[ids].tolist(), strict=True)]
        lexical = store.lexical.term_scores(query, texts)
        words = [j for j in np.argsort(-lexical, kind="stable").tolist() if lexical[j] > 0]
        return [j for j, _ in self.ranking.fused([dense, words])]

    def _touch(self, owner: np.ndarray, ids: np.ndarray, i: int, j: int) -> bool:
        """Whether sentence j of the candidates is sentence i itself or the one right after it in its document."""
        if ids[j] - ids[i] not in (0, 1):
            return False
        return bool(self.store.chunks.documents[owner[i]] == self.store.chunks.documents[owner[j]])

    def _sentence_piece(self, owner: np.ndarray, ids: np.ndarray, run: list[int], similarity: np.ndarray) -> ContextPiece:
        store = self.store
        document_id, text = store.documents[store.chunks.documents[owner[run[0]]]]
        start, end = int(store.sentences.spans[ids[run[0]], 0]), int(store.sentences.spans[ids[run[-1]], 1])
        score = float(max(similarity[j] for j in run))
        item = RetrievedItem(chunk_id=int(owner[run[0]]), document_id=document_id, char_start=start, char_end=end, score=score)
        return ContextPiece(text[start:end], item)

    def whole_chunks(self, chosen: dict[int, float], room: int = 0) -> list[ContextPiece]:
        """The chosen chunks in document order, consecutive chunks of one document as one excerpt;
        with `room` tokens to spare, excerpts widened to whole sentences (`_widened`)."""
        documents, spans = self.store.chunks.documents, self.store.chunks.spans
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
            text = self.store.documents[document][1]
            low = widened[-1][2] if widened and widened[-1][0] == document else 0
            following = excerpts[i + 1] if i + 1 < len(excerpts) else None
            high = following[1] if following is not None and following[0] == document else len(text)
            first = sentence_start(text, start, reach=reach, low=low)
            if (added := self.token_count(text[first:start])) <= room:
                room, start = room - added, first
            last = sentence_end(text, end, reach=reach, high=high)
            if (added := self.token_count(text[end:last])) <= room:
                room, end = room - added, last
            widened.append((document, start, end))
        return widened

    def token_count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0

    def _piece(self, run: list[int], excerpt: tuple[int, int, int], scores: dict[int, float]) -> ContextPiece:
        document, start, end = excerpt
        document_id, text = self.store.documents[document]
        score = max(scores[row] for row in run)
        item = RetrievedItem(chunk_id=run[0], document_id=document_id, char_start=start, char_end=end, score=score)
        return ContextPiece(text[start:end], item)

    def sentences(self, sentences: list[Sentence], strategy: str) -> list[ContextPiece]:
        """Gathered sentences (gather.py), in document order, as excerpts: sentences with only
        spaces between them are one excerpt; each names the chunk it starts in, scored by the
        number of the question's names it holds."""
        store, pieces = self.store, []
        runs = _runs(
            list(range(len(sentences))),
            lambda i, j: (
                sentences[j].document == sentences[i].document
                and not store.documents[sentences[i].document][1][sentences[i].end : sentences[j].start].strip()
            ),
        )
        for run in runs:
            first, last = sentences[run[0]], sentences[run[-1]]
            document_id, text = store.documents[first.document]
            rows = np.nonzero(store.chunks.documents == first.document)[0]
            chunk = int(rows[max(0, int(np.searchsorted(store.chunks.spans[rows, 0], first.start, side="right")) - 1)])
            score = float(max(len(sentences[i].names) for i in run))
            item = RetrievedItem(
                chunk_id=chunk, document_id=document_id, char_start=first.start, char_end=last.end, score=score, gathered=strategy
            )
            pieces.append(ContextPiece(text[first.start : last.end], item))
        return pieces
