"""Neurocache memory: the session's documents as compressed hidden states in a FIFO state cache.

Ingestion runs each segment through the base model up to the retrieval layer and appends C
(positions restart at 0 in every segment; a segment never sees its own states). Answering attaches
the cache to the adapted model: every token, prompt and generated, retrieves once; the cache is
read-only while answering. A session made with `"remember": true` then writes each answered turn
(the prompt's and the answer's states) to the cache as a block of its own, so later questions can
retrieve earlier turns.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.interface import CacheInfo, GenerationDone, GenerationEvent, Retrieval
from engine.memories.base import AnswerRequest, ContextPiece, Memory, MemoryContext, MemoryWrite, Scope, Segment
from engine.memories.neurocache.adapter import CacheBinding, Neurocache
from engine.memories.neurocache.adapter_io import load_adapter
from engine.prompts import history_tokens, render
from engine.runtime.generation import generate_steps

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.models.loader import LoadedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NeurocacheOptions:
    capacity: int | None = None  # m; None: the adapter's setting
    remember: bool = False  # write each answered turn to the cache

    def __post_init__(self) -> None:
        if self.capacity is not None and not 1 <= self.capacity <= 4_000_000:
            raise ValueError("capacity must be between 1 and 4000000")
        if not isinstance(self.remember, bool):
            raise ValueError("remember must be true or false")


class NeurocacheMemory(Memory):
    kind = "neurocache"
    options_type = NeurocacheOptions
    runs_on_model = True

    def __init__(self, context: MemoryContext, options: dict[str, Any]) -> None:
        self.options: NeurocacheOptions = self.read_options(options)
        adapter = context.resources.get(self.kind)
        if adapter is None:
            raise ValueError("this model has no Neurocache adapter")
        self.neurocache: Neurocache = adapter
        self.cache = self.neurocache.new_cache(capacity=self.options.capacity)
        self._documents: list[str] = []
        self._staged: tuple[str, int] | None = None  # (document id, states written)
        self._turns = 0  # remembered turns
        self._blocks = 0  # documents and turns begun: each block's states carry its own number
        self.epoch = 0  # bumped when the cache is emptied or replaced

    @classmethod
    def model_resources(cls, loaded: LoadedModel, config: EngineConfig) -> Neurocache | None:
        """The first Neurocache adapter named after the model in the configured adapter folders, if any."""
        for folder in config.models.adapter_dirs:
            candidate = Path(folder).expanduser() / loaded.name
            if (candidate / "adapter.json").is_file():
                adapter = load_adapter(loaded.model, loaded.tokenizer, candidate)
                log.info("model %s: Neurocache adapter from %s", loaded.name, candidate)
                return adapter
        return None

    @classmethod
    def available(cls, context: MemoryContext) -> bool:
        return context.resources.get(cls.kind) is not None

    @classmethod
    def initial_bytes(cls, context: MemoryContext, options: dict[str, Any]) -> int:
        adapter: Neurocache | None = context.resources.get(cls.kind)
        if adapter is None:
            return 0  # refused when made
        return adapter.cache_bytes(cls.read_options(options).capacity)

    def begin_document(self, document_id: str, text: str, tokens: int) -> None:
        self.cache.begin()
        self._staged = (document_id, 0)
        self._blocks += 1

    def add_segment(self, segment: Segment) -> None:
        assert self._staged is not None, "begin_document first"
        device = next(self.neurocache.projection.parameters()).device
        ids = torch.tensor([segment.token_ids], device=device)
        compressed = self.neurocache.compress(ids)[0]  # T, d
        self.cache.add(compressed, document=self._blocks)
        self._staged = (self._staged[0], self._staged[1] + len(segment.token_ids))

    def staged_bytes(self) -> int:
        return 0  # the cache is allocated whole when the session is made (initial_bytes)

    def commit_document(self) -> None:
        assert self._staged is not None, "begin_document first"
        self.cache.commit()
        self._documents.append(self._staged[0])
        self._staged = None

    def abort_document(self) -> None:
        self.cache.rollback()
        self._staged = None

    def estimate_bytes(self, chars: int, tokens: int) -> int:
        return 0

    def retrieve(self, query: str, max_tokens: int, scope: Scope | None = None) -> list[ContextPiece]:
        return []  # retrieval happens inside the model, once per token

    def answer_steps(self, request: AnswerRequest) -> Iterator[GenerationEvent | MemoryWrite]:
        """The question alone in the prompt; every forward pass retrieves from the cache. With
        `remember`, the answered turn is written after the answer (earlier turns sent along are not)."""
        binding, epoch = self.binding(), self.epoch
        prompt_ids = render(request.tokenizer, request.messages)
        yield Retrieval(self.kind, (), request.retrieval_seconds)
        step_context = functools.partial(self.neurocache.active, binding)
        steps = generate_steps(request.model, request.tokenizer, prompt_ids, request.params, request.stop_tokens, step_context)
        for event in steps:
            if isinstance(event, GenerationDone) and binding.record:
                earlier = history_tokens(request.tokenizer, request.messages[:-1], prompt_ids)
                yield MemoryWrite(functools.partial(self.remember, binding, epoch, earlier))
            yield event

    def binding(self) -> CacheBinding:
        """One answer's view of the cache; it records the answer's states when turns are remembered."""
        return CacheBinding([self.cache], record=[] if self.options.remember else None)

    def remember(self, binding: CacheBinding, epoch: int, skip: int = 0) -> bool:
        """Write an answered turn's recorded states, less the first `skip` (earlier turns sent
        along with it), as a block of their own: retrieval windows never run into a document or
        another turn. Nothing is written if the cache was emptied or replaced since the answer
        began (`epoch`). Returns whether a turn was written."""
        if not binding.record or epoch != self.epoch:
            return False
        states = torch.cat([recorded[0] for recorded in binding.record])[skip:]
        if states.shape[0] == 0:
            return False
        self._blocks += 1
        self.cache.add(states, document=self._blocks)
        self._turns += 1
        return True

    def stats(self) -> CacheInfo:
        return CacheInfo(
            memory=self.kind,
            entries=self.cache.size,
            bytes=self.cache.nbytes,
            capacity=self.cache.capacity,
            documents=len(self._documents),
            turns=self._turns,
            dropped_tokens=self.dropped_tokens(),
        )

    def dropped_tokens(self) -> int:
        return self.cache.written - self.cache.size  # one state a token, the oldest overwritten first

    def reset(self) -> None:
        self.cache.reset()
        self._documents, self._staged = [], None
        self._turns, self._blocks, self.epoch = 0, 0, self.epoch + 1

    def state_dict(self) -> dict[str, Any]:
        """The rows written so far (slots fill from 0 and are reused only after a wrap, so they
        are the first `size`), not the whole preallocated cache."""
        size = self.cache.size
        return {
            "documents": list(self._documents),
            "capacity": self.cache.capacity,
            "states": self.cache.states[:size].clone(),
            "slot_counter": self.cache.slot_counter[:size].clone(),
            "slot_document": self.cache.slot_document[:size].clone(),
            "written": self.cache.written,
            "turns": self._turns,
            "blocks": self._blocks,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        size = state["states"].shape[0]
        if state.get("capacity", self.cache.capacity) != self.cache.capacity or size > self.cache.capacity:
            raise ValueError("saved cache has another capacity")
        if state["states"].shape[1:] != self.cache.states.shape[1:]:
            raise ValueError("saved cache has another dimension")
        self.reset()
        self._documents = list(state["documents"])
        self.cache.states[:size] = state["states"]
        self.cache.slot_counter[:size] = state["slot_counter"]
        self.cache.slot_document[:size] = state["slot_document"]
        self.cache.written = int(state["written"])
        self._turns = int(state.get("turns", 0))
        self._blocks = int(state.get("blocks", int(self.cache.slot_document.max()) + 1))
