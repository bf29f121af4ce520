"""Baseline memory: keep the tail of the document that fits the window, put it before the question."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from engine.interface import CacheInfo, RetrievedItem
from engine.memories.base import ContextPiece, Memory, MemoryContext, Scope, Segment

_BYTES_PER_TOKEN = 4 + 8  # int32 id + two int32 character offsets


@dataclass(frozen=True)
class TruncateOptions:
    window_tokens: int = 2048

    def __post_init__(self) -> None:
        if not 16 <= self.window_tokens <= 1_000_000:
            raise ValueError("window_tokens must be between 16 and 1000000")


class TruncateMemory(Memory):
    kind = "truncate"
    options_type = TruncateOptions

    def __init__(self, context: MemoryContext, options: dict[str, Any]) -> None:
        self.options: TruncateOptions = self.read_options(options)
        self._tokenizer = context.tokenizer
        self._doc_ids: list[str] = []  # committed documents, in order
        self._tail: list[tuple[str, np.ndarray, np.ndarray]] = []  # (document id, ids [n], spans [n, 2])
        self._staged: tuple[str, list[int], list[tuple[int, int]]] | None = None
        self._staged_tokens = 0
        self._fed = 0  # tokens of all committed documents

    def begin_document(self, document_id: str, text: str, tokens: int) -> None:
        self._staged, self._staged_tokens = (document_id, [], []), 0

    def add_segment(self, segment: Segment) -> None:
        assert self._staged is not None, "begin_document first"
        _, ids, spans = self._staged
        ids.extend(segment.token_ids)
        spans.extend(segment.token_spans)
        self._staged_tokens += len(segment.token_ids)
        keep = self.options.window_tokens
        del ids[:-keep], spans[:-keep]

    def staged_bytes(self) -> int:
        return 0 if self._staged is None else len(self._staged[1]) * _BYTES_PER_TOKEN

    def commit_document(self) -> None:
        assert self._staged is not None, "begin_document first"
        document_id, ids, spans = self._staged
        self._doc_ids.append(document_id)
        if ids:
            self._tail.append((document_id, np.asarray(ids, np.int32), np.asarray(spans, np.int32).reshape(-1, 2)))
        self._trim()
        self._staged, self._fed = None, self._fed + self._staged_tokens

    def abort_document(self) -> None:
        self._staged = None

    def _held(self) -> int:
        return sum(len(ids) for _, ids, _ in self._tail)

    def _trim(self) -> None:
        excess = self._held() - self.options.window_tokens
        while excess > 0:
            document_id, ids, spans = self._tail[0]
            if len(ids) <= excess:
                self._tail.pop(0)
                excess -= len(ids)
            else:
                self._tail[0] = (document_id, ids[excess:], spans[excess:])
                excess = 0

    def estimate_bytes(self, chars: int, tokens: int) -> int:
        return min(tokens, self.options.window_tokens) * _BYTES_PER_TOKEN

    def retrieve(self, query: str, max_tokens: int, scope: Scope | None = None) -> list[ContextPiece]:
        pieces: list[ContextPiece] = []
        budget = max_tokens
        for document_id, ids, spans in reversed(self._tail):
            if budget <= 0:
                break
            ids, spans = ids[-budget:], spans[-budget:]
            budget -= len(ids)
            item = RetrievedItem(
                chunk_id=len(pieces), document_id=document_id, char_start=int(spans[0, 0]), char_end=int(spans[-1, 1])
            )
            pieces.append(ContextPiece(cast(str, self._tokenizer.decode(ids.tolist())), item))  # one sequence: one text
        pieces.reverse()
        return pieces

    def stats(self) -> CacheInfo:
        entries = self._held()
        return CacheInfo(
            memory=self.kind,
            entries=entries,
            bytes=entries * _BYTES_PER_TOKEN,
            capacity=self.options.window_tokens,
            documents=len(self._doc_ids),
            dropped_tokens=self._fed - entries,
            bytes_per_token=_BYTES_PER_TOKEN,
        )

    def dropped_tokens(self) -> int:
        return self._fed - self._held()

    def reset(self) -> None:
        self._doc_ids, self._tail, self._staged, self._fed = [], [], None, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "documents": list(self._doc_ids),
            "tail_documents": [d for d, _, _ in self._tail],
            "tail_ids": [ids.copy() for _, ids, _ in self._tail],
            "tail_spans": [spans.copy() for _, _, spans in self._tail],
            "fed": self._fed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._doc_ids = list(state["documents"])
        self._tail = [
            (d, np.asarray(i, np.int32), np.asarray(s, np.int32).reshape(-1, 2))
            for d, i, s in zip(state["tail_documents"], state["tail_ids"], state["tail_spans"], strict=True)
        ]
        self._staged = None
        self._fed = int(state.get("fed", self._held()))
