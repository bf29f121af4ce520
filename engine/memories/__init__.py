"""Session memories, chosen by name from a registry."""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequestError
from engine.memories.base import ContextPiece, Memory, MemoryContext, Scope, Segment
from engine.memories.kvcache.memory import KVCacheMemory
from engine.memories.neurocache.memory import NeurocacheMemory
from engine.memories.text.memory import TextMemory
from engine.memories.truncate import TruncateMemory

MEMORIES: dict[str, type[Memory]] = {cls.kind: cls for cls in (TruncateMemory, TextMemory, NeurocacheMemory, KVCacheMemory)}
FORMER_NAMES: dict[str, str] = {}  # a memory's earlier name -> its kind, for sessions saved under the old name


def register_memory(memory: type[Memory], *, former_names: tuple[str, ...] = ()) -> None:
    """A plugin's memory (engine/plugins.py), chosen by its `kind` like the engine's own. Sessions
    saved under one of its `former_names` are read back as this memory's."""
    if MEMORIES.get(memory.kind, memory) is not memory:
        raise ValueError(f"a different memory is already named {memory.kind!r}")
    MEMORIES[memory.kind] = memory
    FORMER_NAMES.update(dict.fromkeys(former_names, memory.kind))


def saved_kind(kind: str) -> str:
    """The memory a saved session's kind names today (its own name, or the one it was renamed to)."""
    return FORMER_NAMES.get(kind, kind)


def memory_type(kind: str) -> type[Memory]:
    if kind not in MEMORIES:
        raise InvalidRequestError(f"unknown memory {kind!r}; choose one of {sorted(MEMORIES)}")
    return MEMORIES[kind]


def check_options(kind: str, options: dict[str, Any]) -> None:
    """Raises InvalidRequestError unless `options` are valid options of memory `kind`: known
    names, JSON types, ranges. What a memory checks only when it is built against a model (such as
    `rerank` needing the served model) is not checked here."""
    memory = memory_type(kind)
    if memory.options_type is not None:  # every memory of the engine's, and `state`, declares it
        memory.read_options(options)


def build_memory(kind: str, context: MemoryContext, options: dict[str, Any]) -> Memory:
    try:
        return memory_type(kind)(context, options)  # type: ignore[call-arg]
    except ValueError as exc:  # e.g. a model without a Neurocache adapter
        raise InvalidRequestError(str(exc)) from exc


__all__ = [
    "MEMORIES",
    "ContextPiece",
    "Memory",
    "MemoryContext",
    "Scope",
    "Segment",
    "build_memory",
    "check_options",
    "memory_type",
    "register_memory",
    "saved_kind",
]
