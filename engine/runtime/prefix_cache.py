"""The keys and values of each session's last prompt, kept so that its next prompt feeds only the
tokens after the longest prefix the two share (llama.cpp's server keeps a slot's last prompt the
same way; vLLM hashes blocks).

What two questions of a session share is the chat template, the system prompt and whatever
leading excerpts both retrieve, in document order. An entry is the prompt's own cache (the model's
dtype), handed over when its prompt is in: no copy. Entries are kept per session, so one session's
prompts never shorten another's first token, which would tell a client what another asked. The
cache holds at most `max_tokens` positions over all sessions, least recently used out first. What
it holds is reserved from the server's memory as optional: keeping an entry never moves a session
out of RAM, and any other reservation takes entries back, least recently used first, before it
would wait, move sessions or be refused (`SessionStore.reclaimers`).

Locks: the model's worker starts and keeps prompts, while the session store drops a session's
entry and reclaims memory under its own lock (`books_lock`), which the engine hands this class to
use as its own (`share_lock`): one lock, so no two are ever taken in opposite orders (a
reservation released by the garbage collector takes it too). Copies are made outside it.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

from engine.errors import LongdocError
from engine.runtime.kv_blocks import Held

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values [1, kv_heads, positions, head_dim]


class Owner(Protocol):
    """Whose prompts share: a session (engine/sessions/store.py's `Session`)."""

    @property
    def id(self) -> str: ...

    @property
    def deleted(self) -> bool: ...


@dataclass(eq=False)
class _Entry:
    ids: list[int]
    layers: Layers
    held: Held


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """Each session's last prompt's keys and values, within a bound of positions and the server's memory."""

    def __init__(self, reserve: Callable[[int], Held], max_tokens: int, least: int = 16) -> None:
        """`reserve(nbytes)` promises bytes of the server's memory that no one else needs now, or
        raises; a prefix shorter than `least` tokens is fed again rather than copied."""
        if max_tokens <= 0 or least <= 0:
            raise ValueError("max_tokens and least must be positive")
        self._reserve = reserve
        self.max_tokens = max_tokens
        self.least = least
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()  # least recently used first
        self._lock: threading.RLock | threading.Lock = threading.Lock()
        self.hits = 0  # prompts that started from a kept prefix
        self.reused_tokens = 0  # prompt tokens those did not feed again

    def share_lock(self, lock: threading.RLock) -> None:
        """Use the session store's lock as this cache's own (before any answer runs)."""
        self._lock = lock

    @property
    def tokens(self) -> int:
        with self._lock:
            return self._tokens()

    @property
    def nbytes(self) -> int:
        """What the kept keys and values hold of the server's memory."""
        with self._lock:
            return sum(entry.held.nbytes for entry in self._entries.values())

    def _tokens(self) -> int:
        return sum(len(entry.ids) for entry in self._entries.values())

    def start(self, owner: Owner, ids: list[int], most: int) -> tuple[DynamicCache, int] | None:
        """A prompt cache holding the owner's kept keys and values for the longest prefix `ids`
        shares with its last prompt, at most `most` tokens, and that prefix's length; None when
        they share fewer than `least`. The cache is a copy: the entry stays as it was."""
        with self._lock:
            entry = self._entries.get(owner.id)
            shared = 0 if entry is None else min(common_prefix(entry.ids, ids), most)
            if entry is None or shared < self.least:
                return None
            self._entries.move_to_end(owner.id)
            self.hits += 1
            self.reused_tokens += shared
        cache = DynamicCache()  # the tensors outlive a drop meanwhile: the entry's reference is ours
        for index, (keys, values) in enumerate(entry.layers):
            cache.update(keys[:, :, :shared], values[:, :, :shared], index)  # concatenated onto nothing: a copy
        return cache, shared

    def keep(self, owner: Owner, ids: list[int], layers: Layers) -> bool:
        """Keep `layers`, the keys and values of `ids`, as the owner's last prompt (its earlier one
        goes); False, keeping nothing for it, when it is longer than the cache, the server's memory
        has no room to spare, or the owner is deleted."""
        self._release([self._pop(owner.id)])
        if len(ids) > self.max_tokens:
            return False
        try:
            held = self._reserve(sum(k.nbytes + v.nbytes for k, v in layers))
        except LongdocError:  # short now, or larger than the whole budget
            return False
        evicted: list[_Entry | None] = []
        with self._lock:  # a delete marks the owner, then drops its entry under this lock
            kept = not owner.deleted
            if kept:
                while self._entries and self._tokens() + len(ids) > self.max_tokens:
                    evicted.append(self._entries.popitem(last=False)[1])
                self._entries[owner.id] = _Entry(list(ids), layers, held)
        if not kept:
            held.release()
        self._release(evicted)
        return kept

    def drop(self, owner_id: str) -> None:
        """Forget the last prompt of a session that left RAM (`SessionStore.on_leave`)."""
        self._release([self._pop(owner_id)])

    def reclaim(self, nbytes: int) -> int:
        """Give back entries, least recently used first, until `nbytes` are freed or none is
        left; the bytes freed (`SessionStore.reclaimers`)."""
        freed: list[_Entry | None] = []
        with self._lock:
            total = 0
            while self._entries and total < nbytes:
                entry = self._entries.popitem(last=False)[1]
                freed.append(entry)
                total += entry.held.nbytes
        return self._release(freed)

    def clear(self) -> bool:
        """Give back everything kept; True when anything was."""
        with self._lock:
            entries: list[_Entry | None] = list(self._entries.values())
            self._entries.clear()
        self._release(entries)
        return bool(entries)

    def _pop(self, owner_id: str) -> _Entry | None:
        with self._lock:
            return self._entries.pop(owner_id, None)

    @staticmethod
    def _release(entries: list[_Entry | None]) -> int:
        """Give the entries' memory back (outside this cache's lock); the bytes released."""
        released = 0
        for entry in entries:
            if entry is not None:
                released += entry.held.nbytes
                entry.held.release()
        return released
