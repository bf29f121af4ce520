"""State memory: the session's documents fed, segment by segment, through a Long-Short or
CacheFormer model, whose own state is the memory.

Ingestion runs each segment through the model, whose per-session state keeps every past segment
(compressed keys/values per layer, and the uncompressed segments that cache attention fetches). Answering feeds the question after the documents and generates,
then rolls the state back, so the memory stays read-only while answering. Documents follow one
another, separated by a blank line, as one continuous text.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.generation import decode_steps
from engine.interface import CacheInfo, GenerationEvent, Retrieval
from engine.memories.base import AnswerRequest, ContextPiece, Memory, MemoryContext, MemoryWrite, Segment, parse_options
from engine.prompts import render
from research.lms.segment_feed import FeedState, Mark, feed

SEPARATOR = "\n\n"


@dataclass(frozen=True)
class StateOptions:
    pass  # the model's checkpoint fixes every setting


class StateMemory(Memory):
    kind = "state"
    runs_on_model = True
    answer_holds_write_lock = True  # answering feeds the state (and rolls it back)

    def __init__(self, context: MemoryContext, options: dict[str, Any]) -> None:
        self.options: StateOptions = parse_options(StateOptions, options)
        if context.state_model is None:
            raise ValueError("memory 'state' needs a Long-Short or CacheFormer checkpoint as the session's model")
        self.model = context.state_model
        self._separator = context.tokenizer(SEPARATOR)["input_ids"]
        self.state = FeedState(self.model)
        self._documents: list[str] = []
        self._staged: tuple[str, Mark, int] | None = None  # (document id, mark, bytes before it)
        self._committed_bytes = self.state.nbytes  # what stats count: not a staged document, not an answer in flight

    @classmethod
    def available(cls, context: MemoryContext) -> bool:
        return context.state_model is not None

    def begin_document(self, document_id: str, text: str, tokens: int) -> None:
        self._staged = (document_id, self.state.mark(), self.state.nbytes)
        if self._documents:
            feed(self.model, self.state, self._separator)

    def add_segment(self, segment: Segment) -> None:
        assert self._staged is not None, "begin_document first"
        feed(self.model, self.state, segment.token_ids)

    def staged_bytes(self) -> int:
        return 0 if self._staged is None else self.state.nbytes - self._staged[2]

    def bytes_per_token(self) -> int:
        """State bytes one token adds: its window key/value, and its share of the compressed segments."""
        cfg = self.model.config
        per_layer = 2 * cfg.dim * 4 * (1 + (1 + cfg.overlap) * cfg.compressed_per_segment / cfg.segment_len)
        return int(per_layer * cfg.n_layers + 0.5)

    def commit_document(self) -> None:
        assert self._staged is not None, "begin_document first"
        self._documents.append(self._staged[0])
        self._staged = None
        self._committed_bytes = self.state.nbytes

    def abort_document(self) -> None:
        if self._staged is not None:
            self.state.rollback(self._staged[1])
        self._staged = None

    def estimate_bytes(self, chars: int, tokens: int) -> int:
        return self.bytes_per_token() * (tokens + len(self._separator))

    def retrieve(self, query: str, max_tokens: int) -> list[ContextPiece]:
        return []  # the documents are in the model's state, not in the prompt

    def answer_room(self, context_len: int) -> int | None:
        return None  # the state has no fixed room; the answer grows it, reserved in answer_bytes

    def answer_bytes(self, overhead: int, max_tokens: int, context_len: int, kv_bytes_per_token: int) -> tuple[int, int]:
        return (overhead + max_tokens + len(self._separator)) * self.bytes_per_token(), 0

    def answer_steps(self, request: AnswerRequest) -> Iterator[GenerationEvent | MemoryWrite]:
        """Generate after the documents; whatever the answer fed is forgotten when it ends."""
        yield Retrieval(self.kind, (), 0.0)
        mark = self.state.mark()
        prompt = (self._separator if self._documents else []) + render(request.tokenizer, request.messages)

        def forward(ids: list[int]) -> torch.Tensor:
            return feed(self.model, self.state, ids)[-1]

        try:
            yield from decode_steps(forward, request.tokenizer, prompt, request.params, request.stop_tokens)
        finally:
            self.state.rollback(mark)

    def stats(self) -> CacheInfo:
        return CacheInfo(
            memory=self.kind,
            entries=self.state.length,
            bytes=self._committed_bytes,
            capacity=0,  # unbounded: the session's byte budget is the limit
            documents=len(self._documents),
        )

    def reset(self) -> None:
        self.state = FeedState(self.model)
        self._documents, self._staged = [], None
        self._committed_bytes = self.state.nbytes

    def state_dict(self) -> dict[str, Any]:
        return {"documents": list(self._documents), "state": self.state.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset()
        self.state.load_state_dict(state["state"])
        self._documents = list(state["documents"])
        self._committed_bytes = self.state.nbytes
