"""The keys and values of each session's last prompt, kept so that its next prompt feeds only the
tokens after the longest prefix the two share (llama.cpp's server keeps a slot's last prompt the
same way; vLLM hashes blocks).

What two questions of a session share is the chat template, the system prompt and whatever
leading excerpts both retrieve, in document order. An entry is the prompt's own cache (the model's
dtype), handed over when its prompt is in: no copy. Entries are kept per scope (a session), so
one session's prompts never shorten another's first token, which would tell a client what another
asked. The cache holds at most `max_tokens` positions over all scopes, least recently used out
first, and what it holds is reserved from the server's memory like everything else; when an
answer finds that memory short, the cache gives all of it back first (engine/runtime/scheduler.py).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from engine.errors import LongdocError
from engine.runtime.kv_blocks import Held

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values [1, kv_heads, positions, head_dim]


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
    """Each scope's last prompt's keys and values, within a bound of positions and the server's memory."""

    def __init__(self, reserve: Callable[[int], Held], max_tokens: int, least: int = 16) -> None:
        """`reserve(nbytes)` promises bytes of the server's memory or raises; a prefix shorter than
        `least` tokens is fed again rather than copied."""
        if max_tokens <= 0 or least <= 0:
            raise ValueError("max_tokens and least must be positive")
        self._reserve = reserve
        self.max_tokens = max_tokens
        self.least = least
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # used on the model's worker; a deleted session drops its entry from elsewhere
        self.hits = 0  # prompts that started from a kept prefix
        self.reused_tokens = 0  # prompt tokens those did not feed again

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

    def start(self, scope: str, ids: list[int], most: int) -> tuple[DynamicCache, int] | None:
        """A prompt cache holding the scope's kept keys and values for the longest prefix `ids`
        shares with its last prompt, at most `most` tokens, and that prefix's length; None when
        they share fewer than `least`. The cache is a copy: the entry stays as it was."""
        with self._lock:
            entry = self._entries.get(scope)
            if entry is None:
                return None
            shared = min(common_prefix(entry.ids, ids), most)
            if shared < self.least:
                return None
            self._entries.move_to_end(scope)
        cache = DynamicCache()
        for index, (keys, values) in enumerate(entry.layers):
            cache.update(keys[:, :, :shared], values[:, :, :shared], index)  # concatenated onto nothing: a copy
        self.hits += 1
        self.reused_tokens += shared
        return cache, shared

    def keep(self, scope: str, ids: list[int], layers: Layers) -> bool:
        """Keep `layers`, the keys and values of `ids`, as the scope's last prompt (its earlier one
        goes); False, keeping nothing for the scope, when it is longer than the cache or the
        server's memory has no room for it."""
        with self._lock:
            self._drop(scope)
            if len(ids) > self.max_tokens:
                return False
            while self._entries and self._tokens() + len(ids) > self.max_tokens:
                self._drop(next(iter(self._entries)))
            try:
                held = self._reserve(sum(k.nbytes + v.nbytes for k, v in layers))
            except LongdocError:  # short now, or larger than the whole budget
                return False
            self._entries[scope] = _Entry(list(ids), layers, held)
            return True

    def drop(self, scope: str) -> None:
        """Forget the scope's last prompt (its session is deleted)."""
        with self._lock:
            self._drop(scope)

    def _drop(self, scope: str) -> None:
        entry = self._entries.pop(scope, None)
        if entry is not None:
            entry.held.release()

    def clear(self) -> bool:
        """Give back everything kept; True when anything was."""
        with self._lock:
            kept = bool(self._entries)
            for scope in list(self._entries):
                self._drop(scope)
            return kept
