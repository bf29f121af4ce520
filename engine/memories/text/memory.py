"""Text retrieval: a session's documents cut into chunks, found by meaning and by words.

Three parts, one job each: what is stored (store.py: chunks, MiniLM vectors in a per-session FAISS
inner-product index, BM25 terms from lexical.py, sentence vectors), how a question ranks the
chunks and which are taken (ranking.py: fused MiniLM and BM25 scores, `top_k`, the token budget,
`margin`), and how the taken chunks become excerpts (excerpts.py: merged where they touch, in
document order, widened to whole sentences, or cut to their best sentences with `focus_tokens`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from engine.interface import CacheInfo, Retrieval, RetrievedItem
from engine.memories.base import AnswerRequest, ContextPiece, Memory, MemoryContext, Scope, Segment, SummaryTask
from engine.memories.text.excerpts import Excerpts
from engine.memories.text.gather import Sentence, gather, merged
from engine.memories.text.locate import Place, asks_whole, places, unplaced
from engine.memories.text.options import TextOptions
from engine.memories.text.question_form import QuestionForm
from engine.memories.text.ranking import Ranking
from engine.memories.text.rerank import QUESTION_TOKENS, frame_tokens, pass_bytes
from engine.memories.text.store import TextStore, sentence_start
from engine.memories.text.summary import SummaryTree, is_summary_question, level_sizes, part_spans


class TextMemory(Memory):
    kind = "text"
    filters_documents = True
    options_type = TextOptions

    def __init__(self, context: MemoryContext, options: dict[str, Any]) -> None:
        read: TextOptions = self.read_options(options)
        if context.embedder is None:
            raise ValueError("text memory needs an embedder")
        if read.rerank and context.model is None:
            raise ValueError("rerank needs the served language model, which this model does not lend its memories")
        self._model, self._tokenizer = context.model, context.tokenizer
        self._rerank_tokens = read.chunk_tokens + frame_tokens(self._tokenizer) + QUESTION_TOKENS if read.rerank else 0
        self.store = TextStore(context.embedder, read)
        self.ranking = Ranking(self.store, self._model, self._tokenizer)
        self.excerpts = Excerpts(self.store, self.ranking, self._tokenizer)
        self.summaries = SummaryTree(context.embedder.dim, read.summary_part_tokens, read.summary_fanout)
        self.form = QuestionForm(context.embedder)
        self._parts: dict[str, list[tuple[int, int]]] = {}  # each document's summary parts, planned once

    @property
    def options(self) -> TextOptions:
        return self.store.options

    @options.setter
    def options(self, options: TextOptions) -> None:
        """A saved session's options, set before `load_state_dict` (kvcache's text index)."""
        self.store.options = options
        self.summaries = SummaryTree(self.summaries.dim, options.summary_part_tokens, options.summary_fanout)

    def begin_document(self, document_id: str, text: str, tokens: int) -> None:
        self.store.begin(document_id, text)

    def add_segment(self, segment: Segment) -> None:
        self.store.add_segment(segment)

    def staged_bytes(self) -> int:
        return self.store.staged_bytes()

    def commit_document(self) -> None:
        self.store.commit()

    def abort_document(self) -> None:
        self.store.abort()

    def estimate_bytes(self, chars: int, tokens: int) -> int:
        return self.store.estimate_bytes(chars, tokens)

    def retrieve(self, query: str, max_tokens: int, scope: Scope | None = None) -> list[ContextPiece]:
        if self.store.index.ntotal == 0:
            return []
        documents = scope.documents if scope is not None else None
        allowed = self._allowed_chunks(documents)
        if allowed is not None and not allowed.any():
            return []
        summaries = self._summary_pieces(query, min(max_tokens, self.options.summary_tokens), scope)
        used = sum(self.excerpts.token_count(piece.text) + 2 for piece in summaries)
        return summaries + self._excerpts(query, max_tokens - used, scope, allowed)

    def _excerpts(self, query: str, max_tokens: int, scope: Scope | None, allowed: np.ndarray | None) -> list[ContextPiece]:
        """The document's own text for `query`: located, gathered and ranked excerpts, by the options."""
        documents = scope.documents if scope is not None else None
        if self.options.locate and scope is not None:
            found = places(query, self.store.documents, scope.layouts, documents)
            if found:
                return self._located(query, max_tokens, found, allowed)
        if not self.options.gather:
            return self._ranked_pieces(query, max_tokens, allowed)
        texts = [text if documents is None or id_ in documents else "" for id_, text in self.store.documents]
        whole = min(max_tokens, self.options.gather_tokens)
        recurring = self.form.reads_whole if self.options.gather_recurring else None
        strategy, sentences = gather(texts, query, whole, min(whole, self.options.lookup_tokens), recurring)
        vector: np.ndarray | None = None  # an exact gathering that fits needs no ranking
        order: list[tuple[int, float]] | None = None
        if strategy != "exact":
            vector = self.ranking.query_vector(query)
            order = self.ranking.ordered(query, vector, allowed)  # ranked once
        if strategy == "whole" and order is not None and self._stands_out(order):
            strategy, sentences = "none", []  # a local question after all: one passage answers it
        gathered = self.excerpts.sentences(sentences, strategy)
        used = sum(self.excerpts.token_count(piece.text) + 2 for piece in gathered)  # and the blank line between
        if strategy == "exact" and used <= whole:
            return gathered  # the ranked chunks would bring back the look-alikes the question rules out
        if used > whole:  # the characters' estimate fell short: never more than the budget
            return self._ranked_pieces(query, max_tokens, allowed, vector, order)
        top_k = self.options.gather_chunks if strategy == "whole" and gathered else None  # None: top_k
        ranked = self._ranked_pieces(query, max_tokens - used, allowed, vector, order, top_k) if top_k != 0 else []
        return merged(gathered, ranked, self.store.documents)

    def _stands_out(self, order: list[tuple[int, float]]) -> bool:
        """Whether the best chunk's fused score stands above the next by more than `margin` (the
        ranking takes it alone): the question's words point at one passage. A question that reads as
        a whole-document one ("how many ribs did Charles break when he threw...") is then a local one."""
        margin = self.options.score_margin()
        return bool(margin) and len(order) >= 2 and order[0][1] - order[1][1] > margin

    def retrieval(self, request: AnswerRequest) -> Retrieval:
        """The event, with the strategy that chose its items: "ranked", or their marks joined by "+"."""
        event = super().retrieval(request)
        marks = sorted({item.gathered for item in event.items if item.gathered is not None})
        return replace(event, strategy="+".join(marks) or "ranked")

    def _summary_pieces(self, query: str, max_tokens: int, scope: Scope | None) -> list[ContextPiece]:
        """Summaries for a whole-document question (summary.py), when the session writes them."""
        if not (self.options.summarize and len(self.summaries) and is_summary_question(query)):
            return []
        documents = scope.documents if scope is not None else None
        store = self.store
        allowed = frozenset(id_ for id_, _ in store.documents if documents is None or id_ in documents)
        found = places(query, store.documents, scope.layouts if scope is not None else {}, documents)
        # an ending: the summary of the place's last part
        spots = [(store.documents[p.document][0], p.end - 1 if p.ending else p.start, p.end) for p in found]
        parts = self.summary_parts()
        tops = frozenset(
            (id_, len(sizes), 0) for id_, spans in parts.items() if (sizes := level_sizes(len(spans), self.summaries.fanout))
        )
        vector = store.embedder.encode([query])[0]
        # each piece's tokens and the blank line after it, as `retrieve` counts them
        chosen = self.summaries.pieces(vector, allowed, spots, max_tokens, lambda text: self.excerpts.token_count(text) + 2, tops)
        first_chunk = {id_: int(np.argmax(store.chunks.documents == n)) for n, (id_, _) in enumerate(store.documents)}
        return [
            ContextPiece(
                text,
                RetrievedItem(
                    first_chunk[node.document_id], node.document_id, node.start, node.end, gathered="summary", text=node.text
                ),
            )
            for node, text in chosen
        ]

    def summary_parts(self) -> dict[str, list[tuple[int, int]]]:
        """Each committed document's summary parts (summary.py), planned from its chunks."""
        store, parts = self.store, self._parts
        missing = [(number, id_) for number, (id_, _) in enumerate(store.documents) if id_ not in parts]
        if missing:  # a new dict, never one changed in place: stats read it from the event loop's thread
            parts = dict(parts)
            for number, id_ in missing:
                mine = store.chunks.documents == number
                parts[id_] = part_spans(store.chunks.spans[mine], store.chunks.tokens[mine], self.summaries.part_tokens)
            self._parts = parts
        return parts

    @property
    def writes_summaries(self) -> bool:
        return self.options.summarize

    def summary_tasks(self, limit: int, busy: frozenset[Any]) -> list[SummaryTask]:
        if not self.options.summarize:
            return []
        return self.summaries.tasks(self.summary_parts(), dict(self.store.documents), limit, busy)

    def add_summary(self, task: SummaryTask, text: str) -> bool:
        document_id = task.key[0]
        if self.summaries.has(task.key) or document_id not in self.summary_parts():
            return False  # cleared since the task was handed out
        self.summaries.add(task, text, self.store.embedder.encode([text.strip()])[0])
        return True

    def summary_bytes(self, task: SummaryTask) -> int:
        return self.summaries.node_bytes(task.max_tokens)

    def _summary_state(self, planned: int) -> str | None:
        if not self.options.summarize:
            return None
        if self.summary_error is not None:
            return f"stopped: {self.summary_error}"
        return "ready" if len(self.summaries) >= planned else "building"

    def _located(self, query: str, max_tokens: int, found: list[Place], allowed: np.ndarray | None) -> list[ContextPiece]:
        """Ranked chunks of the places only; for an ending, the places' last `tail_tokens` too."""
        inside = self._overlapping([(place.document, place.start, place.end) for place in found])
        if allowed is not None:
            inside &= allowed
        endings = [place for place in found if place.ending]
        tails: list[ContextPiece] = []
        if endings:
            each = min(self.options.tail_tokens, max_tokens // 2) // len(endings)
            for place in endings:
                text = self.store.documents[place.document][1]
                at = max(place.start, place.end - each * CHARS_PER_TOKEN)
                start = sentence_start(text, at, reach=300, low=place.start)
                tails += self.excerpts.sentences([Sentence(place.document, start, place.end, frozenset())], "tail")
        used = sum(self.excerpts.token_count(piece.text) + 2 for piece in tails)
        if used > max_tokens:  # the characters' estimate fell short: never more than the budget
            tails, used = [], 0
        if not inside.any():
            return merged(tails, self._ranked_pieces(query, max_tokens - used, allowed), self.store.documents)
        if asks_whole(query):  # "What happens in Act III, Scene 3?": no part of the place before another
            body = self._spread(inside & ~self._covered(tails), max_tokens - used)
        else:
            body = self._ranked_pieces(unplaced(query), max_tokens - used, inside)
        pieces = self._clipped(merged(tails, body, self.store.documents), found)
        # chunks taken within the place (ranked or spread): marked, so the strategy shows
        return [
            piece if piece.item.gathered else ContextPiece(piece.text, replace(piece.item, gathered="located"))
            for piece in pieces
        ]

    def _spread(self, inside: np.ndarray, max_tokens: int) -> list[ContextPiece]:
        """The chunks `inside` a place, spread evenly over it in document order, as many as the
        budget holds (all of them when the place fits), as excerpts."""
        rows, tokens = np.nonzero(inside)[0], self.store.chunks.tokens
        budget = min(max_tokens, self.options.context_tokens)
        if not len(rows):
            return []
        count = min(len(rows), budget // max(1, int(tokens[rows].min())))
        while count > 0:
            picked = rows[np.round(np.linspace(0, len(rows) - 1, count)).astype(int)]
            if (taken := int(tokens[picked].sum())) <= budget:
                return self.excerpts.whole_chunks({int(row): 0.0 for row in picked}, budget - taken)
            count -= 1
        return []

    def _covered(self, pieces: list[ContextPiece]) -> np.ndarray:
        """Which chunks overlap one of `pieces` (a mask over the chunks)."""
        numbers = self.store.numbers()
        return self._overlapping([(numbers[p.item.document_id], p.item.char_start, p.item.char_end) for p in pieces])

    def _overlapping(self, spans: list[tuple[int, int, int]]) -> np.ndarray:
        """Which chunks overlap one of `spans` ((document number, start, end) each; a mask over the chunks)."""
        chunks = self.store.chunks
        mask = np.zeros(len(chunks), bool)
        for document, start, end in spans:
            mask |= (chunks.documents == document) & (chunks.spans[:, 0] < end) & (chunks.spans[:, 1] > start)
        return mask

    def _clipped(self, pieces: list[ContextPiece], found: list[Place]) -> list[ContextPiece]:
        """Excerpts cut to the places they overlap: a chunk ranked inside a chapter that begins in the
        chapter before starts at the heading, so the reader reads only the place asked about."""
        numbers = self.store.numbers()
        out = []
        for piece in pieces:
            item, number = piece.item, numbers[piece.item.document_id]
            spans = [
                (p.start, p.end) for p in found if p.document == number and p.start < item.char_end and item.char_start < p.end
            ]
            if not spans:
                out.append(piece)
                continue
            start, end = max(item.char_start, min(a for a, _ in spans)), min(item.char_end, max(b for _, b in spans))
            text = self.store.documents[number][1][start:end]
            start, end = start + len(text) - len(text.lstrip()), end - (len(text) - len(text.rstrip()))
            if end > start:
                out.append(ContextPiece(text.strip(), replace(item, char_start=start, char_end=end)))
        return out

    def _allowed_chunks(self, documents: frozenset[str] | None) -> np.ndarray | None:
        """Which chunks belong to `documents` (a mask over the chunks); None: every chunk."""
        if documents is None:
            return None
        numbers = [number for id_, number in self.store.numbers().items() if id_ in documents]
        return np.isin(self.store.chunks.documents, numbers)

    def _ranked_pieces(
        self,
        query: str,
        max_tokens: int,
        allowed: np.ndarray | None = None,
        vector: np.ndarray | None = None,
        order: list[tuple[int, float]] | None = None,
        top_k: int | None = None,
    ) -> list[ContextPiece]:
        """The chunks the fused ranking takes (of the `allowed` ones), as excerpts (`vector`, `order`:
        the question's vector and the ranking's order, when already computed; `top_k`: at most this
        many chunks, the option's unless given)."""
        query_vector = vector if vector is not None else self.ranking.query_vector(query)
        budget = min(max_tokens, self.options.context_tokens)
        chosen = self.ranking.chosen(query, query_vector, budget, allowed, order, top_k)
        if self.options.focus_tokens:
            assert query_vector is not None
            return self.excerpts.focus(query, query_vector, chosen, min(max_tokens, self.options.focus_tokens))
        room = budget - int(self.store.chunks.tokens[list(chosen)].sum())
        return self.excerpts.whole_chunks(chosen, room)

    def ranked_spans(self, query: str) -> list[tuple[str, int, int, float]]:
        """(document id, start, end, score) of the chunks in the order `retrieve` takes them for
        `query`, before `top_k`, the token budget and `margin` cut it; to measure where a passage
        ranks and how far below the first (`longdoc eval ranks`). Not every chunk: the best
        max(50, 4·top_k) of each ranking (with rank fusion, the union of two; BM25 alone, only
        chunks that hold a word of the question), with `rerank` the first `rerank` in the reader's
        order."""
        store = self.store
        if store.index.ntotal == 0:
            return []
        ranked = self.ranking.ordered(query, self.ranking.query_vector(query))
        rows = [row for row, _ in ranked]
        documents, spans = store.chunks.documents[rows].tolist(), store.chunks.spans[rows].tolist()
        return [(store.documents[d][0], a, b, score) for d, (a, b), (_, score) in zip(documents, spans, ranked, strict=True)]

    def answer_bytes(self, overhead: int, max_tokens: int, context_len: int, kv_bytes_per_token: int) -> tuple[int, int]:
        """The answer's, or, when larger, the reranking pass's (it ends before the answer starts)."""
        kept, transient = super().answer_bytes(overhead, max_tokens, context_len, kv_bytes_per_token)
        if self.options.rerank:
            element = next(self._model.parameters()).element_size()
            transient = max(transient, pass_bytes(self._model.config, self._rerank_tokens, self.options.rerank, element))
        return kept, transient

    def document_text(self, document_id: str) -> str | None:
        return next((text for id_, text in self.store.documents if id_ == document_id), None)

    def stats(self) -> CacheInfo:
        planned = self.summaries.planned(self.summary_parts()) if self.options.summarize else 0
        return CacheInfo(
            memory=self.kind,
            entries=int(self.store.index.ntotal),
            bytes=self.store.nbytes + self.summaries.nbytes,
            capacity=self.options.max_chunks,
            documents=len(self.store.documents),
            summaries=len(self.summaries),
            summaries_planned=planned,
            summary_state=self._summary_state(planned),
        )

    def reset(self) -> None:
        self.store.reset()
        self.summaries.reset()
        self._parts = {}

    def state_dict(self) -> dict[str, Any]:
        return {**self.store.state_dict(), **self.summaries.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._parts = {}
        if self.store.load_state_dict(state):
            self.remade_on_load = True
        self.summaries.load_state_dict(state)
        if self.remade_on_load and len(self.summaries):  # another embedder: the summaries' vectors too
            self.summaries.vectors = self.store.embedder.encode([node.text for node in self.summaries.nodes]).astype(np.float32)


CHARS_PER_TOKEN = 4  # English prose, about; the tail's pieces are counted in tokens after
