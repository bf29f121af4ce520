"""State memory: the session's documents fed, segment by segment, through a from-scratch LM, whose
own state is the memory: what each family keeps is in research/lms/feeders.py (Long-Short and
CacheFormer keep every past segment, segment-cache its memory and cache, the others their last
window).

Answering feeds the question after the documents and generates, then rolls the state back, so the
memory stays read-only while answering. Documents follow one another, separated by a blank line,
as one continuous text.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from engine.interface import CacheInfo, GenerationEvent, Retrieval
from engine.memories.base import AnswerRequest, ContextPiece, Memory, MemoryContext, MemoryWrite, Scope, Segment
from engine.prompts import render
from engine.runtime.generation import decode_steps
from research.lms.feeders import feeder_for

SEPARATOR = "\n\n"


@dataclass(frozen=True)
class StateOptions:
    pass  # the model's checkpoint fixes every setting


class StateMemory(Memory):
    kind = "state"
    options_type = StateOptions
    runs_on_model = True
    answer_holds_write_lock = True  # answering feeds the state (and rolls it back)
    dropped_advice = "This model's own state reaches no further back; a longer text is read through its most recent part."

    def __init__(self, context: MemoryContext, options: dict[str, Any]) -> None:
        self.options: StateOptions = self.read_options(options)
        if context.state_model is None:
            raise ValueError(
                "memory 'state' needs a from-scratch LM checkpoint (transformer, Long-Short, CacheFormer, ...) as the session's model"
            )
        self.model = context.state_model
        self._separator = context.tokenizer(SEPARATOR)["input_ids"]
        self.state = feeder_for(self.model)
        self._documents: list[str] = []
        self._staged: tuple[str, Any, int] | None = None  # (document id, mark, bytes before it)
        self._committed_bytes = self.state.nbytes  # what stats count: not a staged document, not an answer in flight
        self._committed_length = 0

    @classmethod
    def available(cls, context: MemoryContext) -> bool:
        return context.state_model is not None

    def begin_document(self, document_id: str, text: str, tokens: int) -> None:
        self._staged = (document_id, self.state.mark(), self.state.nbytes)
        separator = self._separator if self._documents else []
        self.state.reserve(len(separator) + tokens)  # counted in estimate_bytes; its segments then copy nothing
        if separator:
            self.state.feed(separator)

    def add_segment(self, segment: Segment) -> None:
        assert self._staged is not None, "begin_document first"
        self.state.feed(segment.token_ids)

    def staged_bytes(self) -> int:
        return 0 if self._staged is None else max(0, self.state.nbytes - self._staged[2])  # a bounded state may shrink

    def bytes_per_token(self) -> int:
        return self.state.bytes_per_token()

    def commit_document(self) -> None:
        assert self._staged is not None, "begin_document first"
        self._documents.append(self._staged[0])
        self._staged = None
        self._committed_bytes, self._committed_length = self.state.nbytes, self.state.length

    def abort_document(self) -> None:
        if self._staged is not None:
            self.state.rollback(self._staged[1])
            self.state.trim()  # the room made for the document is given back
        self._staged = None
        self._committed_bytes = self.state.nbytes

    def estimate_bytes(self, chars: int, tokens: int) -> int:
        return self.state.growth(tokens + len(self._separator))

    def retrieve(self, query: str, max_tokens: int, scope: Scope | None = None) -> list[ContextPiece]:
        return []  # the documents are in the model's state, not in the prompt

    def answer_room(self, context_len: int) -> int | None:
        return self.state.answer_room()  # None: the answer grows the state, reserved in answer_bytes

    def dropped_tokens(self) -> int:
        reach = self.state.reach()
        return 0 if reach is None else max(0, self._committed_length - reach)

    def answer_bytes(self, overhead: int, max_tokens: int, context_len: int, kv_bytes_per_token: int) -> tuple[int, int]:
        return self.state.growth(overhead + max_tokens + len(self._separator)), 0

    def answer_steps(self, request: AnswerRequest) -> Iterator[GenerationEvent | MemoryWrite]:
        """Generate after the documents; whatever the answer fed is forgotten when it ends."""
        yield Retrieval(self.kind, (), 0.0)
        mark = self.state.mark()
        prompt = (self._separator if self._documents else []) + render(request.tokenizer, request.messages)
        self.state.reserve(len(prompt) + request.params.max_tokens)  # counted in answer_bytes
        try:
            yield from decode_steps(self.state.feed, request.tokenizer, prompt, request.params, request.stop_tokens)
        finally:
            self.state.rollback(mark)
            self._committed_bytes = self.state.nbytes  # the room made for it is still held

    def stats(self) -> CacheInfo:
        reach = self.state.reach()
        return CacheInfo(
            memory=self.kind,
            entries=self._committed_length if reach is None else min(self._committed_length, reach),
            bytes=self._committed_bytes,
            capacity=reach or 0,  # 0: every token; the session's byte budget is the limit
            documents=len(self._documents),
            bytes_per_token=self.bytes_per_token(),
            dropped_tokens=self.dropped_tokens(),
        )

    def reset(self) -> None:
        self.state = feeder_for(self.model)
        self._documents, self._staged = [], None
        self._committed_bytes, self._committed_length = self.state.nbytes, 0

    def state_dict(self) -> dict[str, Any]:
        return {"documents": list(self._documents), "state": self.state.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset()
        self.state.load_state_dict(state["state"])
        self._documents = list(state["documents"])
        self._committed_bytes, self._committed_length = self.state.nbytes, self.state.length
