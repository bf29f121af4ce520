"""The key/value memory of one model's batched answers, held from the server's budget in blocks of
`block_tokens` positions as it is used.

A row holds the blocks its prompt fills (and, while its prompt is fed, what the prompt's own cache
takes), then more blocks as its answer writes, never past prompt + max_tokens. Growing a row's
keys and values copies them into a larger buffer, so for that moment it holds the old and the new
blocks together. When the server's memory is short, a row that has not started waits, and a row
that needs a block takes it from the youngest row, which is preempted: it gives back its blocks,
goes to the head of the queue and later recomputes its prompt and the tokens it had written.
engine/runtime/scheduler.py decides when; this class keeps the books.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from engine.errors import BudgetExceededError


class Held(Protocol):
    """A reservation of the server's memory (engine/sessions/store.py's `Reservation`)."""

    nbytes: int

    def grow_to(self, nbytes: int) -> None: ...

    def shrink_to(self, nbytes: int) -> None: ...

    def release(self) -> None: ...


class KVBlocks:
    """Blocks held by one model's rows, counted against the server's memory."""

    def __init__(
        self, reserve: Callable[[int], Held], block_tokens: int, bytes_per_token: int, wait_seconds: float = 60.0
    ) -> None:
        """`reserve(nbytes)` promises bytes of the server's memory or raises BudgetExceededError
        (short now) or TooLargeError (never)."""
        if block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        self._reserve = reserve
        self.block_tokens = block_tokens
        self.bytes_per_token = bytes_per_token
        self.wait_seconds = wait_seconds  # a row that waits this long with no answer running to free memory fails
        self.in_use = 0  # blocks held by rows, the copies of growing rows included
        self.preemptions = 0

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.bytes_per_token

    def blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_tokens)

    def peak_bytes(self, tokens: int) -> int:
        """The most an answer of `tokens` positions holds at once: its blocks, and as many again
        while it copies them into larger buffers (or while its prompt's own cache is fed)."""
        return 2 * (self.blocks(tokens) + 1) * self.block_bytes

    def hold(self, holder: Holder, blocks: int, extra_bytes: int = 0) -> bool:
        """Make `holder` hold `blocks` blocks, and `extra_bytes` besides (a prompt's cache while it
        is fed): more or fewer than it holds. False, holding what it held, when the server's memory
        is short now; TooLargeError when it could never fit."""
        nbytes = blocks * self.block_bytes + extra_bytes
        if holder.kv is None:
            try:
                holder.kv = self._reserve(nbytes)
            except BudgetExceededError:
                return False
        elif nbytes >= holder.kv.nbytes:
            try:
                holder.kv.grow_to(nbytes)
            except BudgetExceededError:
                return False
        else:
            holder.kv.shrink_to(nbytes)
        self.in_use += blocks - holder.blocks
        holder.blocks = blocks
        return True

    def release(self, holder: Holder) -> None:
        """Give back all `holder` holds; releasing twice is harmless."""
        if holder.kv is not None:
            holder.kv.release()
            holder.kv = None
        self.in_use -= holder.blocks
        holder.blocks = 0


class Holder(Protocol):
    """What holds blocks (engine/models/llama_step.py's `Row`)."""

    kv: Held | None
    blocks: int
