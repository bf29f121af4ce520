"""Neurocache's per-session cache of compressed hidden states: a FIFO ring buffer with kNN lookup.

Every stored state has a global write counter t and lives in slot t % capacity. Bookkeeping is by
counters, never by inspecting vector contents (a normalised vector can sum to zero). A match's
retrieval window (w) takes the states written right after it, but only while they are still
resident (not overwritten after a wrap-around), already written, and from the same document.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.memories.neurocache.knn import KnnBackend, backend_for

_FORMAT = "longdoc-state-cache-v1"


@dataclass(frozen=True)
class Retrieved:
    """For each query: k * w states with a mask of which are real."""

    states: torch.Tensor  # q, k * w, d
    mask: torch.Tensor  # q, k * w (bool)
    values: torch.Tensor | None = None  # q, k * w, value_dim when the cache keeps values


class StateCache:
    def __init__(
        self,
        *,
        capacity: int,
        dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        backend: KnnBackend | None = None,
        value_dim: int = 0,
    ) -> None:
        """`value_dim` > 0 keeps a value vector beside each state (training keeps the uncompressed
        hidden states there, so retrieved entries can be re-projected with gradients)."""
        if capacity < 1 or dim < 1:
            raise ValueError("capacity and dim must be positive")
        self.capacity, self.dim = capacity, dim
        self.device, self.dtype = torch.device(device), dtype
        self.backend = backend or backend_for(self.device)
        self._rows = self.backend.allocate(capacity, dim, dtype, self.device)
        self.states = self._rows.rows  # capacity, dim; always written in place
        self.values = torch.zeros(capacity, value_dim, device=self.device, dtype=dtype) if value_dim else None
        self.slot_counter = torch.full((capacity,), -1, dtype=torch.long, device=self.device)  # -1: never written
        self.slot_document = torch.full((capacity,), -1, dtype=torch.long, device=self.device)
        self.written = 0  # states written since the last reset
        self._undo: list[tuple[torch.Tensor, ...]] | None = None  # overwritten slots since `begin`
        self._undo_written = 0

    @property
    def size(self) -> int:
        """Valid entries: what has been written, up to capacity."""
        return min(self.written, self.capacity)

    @property
    def nbytes(self) -> int:
        return self.bytes_for(self.capacity, self.dim, self.dtype, self.values.shape[1] if self.values is not None else 0)

    @staticmethod
    def bytes_for(capacity: int, dim: int, dtype: torch.dtype, value_dim: int = 0) -> int:
        """What a cache of this shape allocates when made: states (and values), and two int64
        counters a slot. Known before allocating, so budgets can refuse it first."""
        element = torch.empty((), dtype=dtype).element_size()
        return capacity * ((dim + value_dim) * element + 2 * 8)

    def add(self, states: torch.Tensor, document: int, values: torch.Tensor | None = None) -> None:
        """Append states [n, d] of one document in order, overwriting the oldest when full."""
        n = states.shape[0]
        if n == 0:
            return
        if states.shape[1] != self.dim:
            raise ValueError(f"states have dim {states.shape[1]}, the cache {self.dim}")
        if (values is None) != (self.values is None):
            raise ValueError("values must be given exactly when the cache keeps them")
        counters = torch.arange(self.written, self.written + n, device=self.device)
        if n > self.capacity:  # only the newest `capacity` survive
            states, counters = states[-self.capacity :], counters[-self.capacity :]
            values = values[-self.capacity :] if values is not None else None
        slots = counters % self.capacity
        if self._undo is not None:
            self._undo.append(
                (slots, self.states[slots].clone(), self.slot_counter[slots].clone(), self.slot_document[slots].clone())
            )
        self.states[slots] = states.to(self.device, self.dtype)
        if values is not None and self.values is not None:
            self.values[slots] = values.to(self.device, self.dtype)
        self.slot_counter[slots] = counters
        self.slot_document[slots] = document
        self.written += n

    def begin(self) -> None:
        """Start a transaction: `rollback` undoes every `add` after this, `commit` keeps them.
        Only the slots an `add` overwrites are copied, so a transaction costs what it writes."""
        self._undo, self._undo_written = [], self.written

    def commit(self) -> None:
        self._undo = None

    def rollback(self) -> None:
        if self._undo is None:
            return
        for slots, states, counters, documents in reversed(self._undo):
            self.states[slots], self.slot_counter[slots], self.slot_document[slots] = states, counters, documents
        self.written, self._undo = self._undo_written, None

    def search(self, queries: torch.Tensor, k: int, window: int = 1) -> Retrieved:
        """Top-k nearest states by L2 for each query [q, d], each with the `window - 1` states
        written after it; entries that do not exist are zero and masked out."""
        q = queries.shape[0]
        states = torch.zeros(q, k * window, self.dim, device=self.device, dtype=self.dtype)
        mask = torch.zeros(q, k * window, dtype=torch.bool, device=self.device)
        if self.size == 0 or q == 0:
            empty = None if self.values is None else states.new_zeros(q, k * window, self.values.shape[1])
            return Retrieved(states, mask, empty)
        found = min(k, self.size)
        _, rows = self.nearest(queries, found)  # q, found
        match_counter = self.slot_counter[rows.to(self.device)]  # q, found
        offsets = torch.arange(window, device=self.device)
        counters = match_counter.unsqueeze(-1) + offsets  # q, found, w
        slots = counters % self.capacity
        ok = (
            (counters < self.written)
            & (self.slot_counter[slots] == counters)  # still resident, not overwritten
            & (self.slot_document[slots] == self.slot_document[slots[..., :1]])  # same document as the match
        )
        states[:, : found * window] = self.states[slots].reshape(q, found * window, self.dim)
        mask[:, : found * window] = ok.reshape(q, found * window)
        states[~mask] = 0
        values = None
        if self.values is not None:
            values = torch.zeros(q, k * window, self.values.shape[1], device=self.device, dtype=self.dtype)
            values[:, : found * window] = self.values[slots].reshape(q, found * window, -1)
            values[~mask] = 0
        return Retrieved(states, mask, values)

    def nearest(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Squared L2 distances and slots of the k nearest valid states, [q, k] each; k <= size.
        Slots fill in order from 0 and are only ever reused after a wrap, so the valid entries are
        always the first `size` rows: they are searched in place."""
        return self._rows.search(queries.to(self.device), k, self.size)

    def reset(self) -> None:
        self.states.zero_()
        self.slot_counter.fill_(-1)
        self.slot_document.fill_(-1)
        self.written = 0
        self._undo = None

    def save(self, folder: Path) -> None:
        """Save to `folder` as safetensors + JSON; `load` restores it bit for bit."""
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {"states": self.states, "slot_counter": self.slot_counter, "slot_document": self.slot_document}
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, folder / "cache.safetensors")
        meta = {
            "format": _FORMAT,
            "capacity": self.capacity,
            "dim": self.dim,
            "written": self.written,
            "dtype": str(self.dtype).removeprefix("torch."),
        }
        (folder / "cache.json").write_text(json.dumps(meta, indent=2))

    @classmethod
    def load(cls, folder: Path, *, device: torch.device | str = "cpu", backend: KnnBackend | None = None) -> StateCache:
        meta = json.loads((folder / "cache.json").read_text())
        if meta.get("format") != _FORMAT:
            raise ValueError(f"{folder} does not hold a {_FORMAT} cache")
        tensors = load_file(folder / "cache.safetensors")
        cache = cls(
            capacity=meta["capacity"], dim=meta["dim"], device=device, dtype=getattr(torch, meta["dtype"]), backend=backend
        )
        if tensors["states"].shape != (cache.capacity, cache.dim):
            raise ValueError("saved states do not match the saved capacity and dim")
        cache.states.copy_(tensors["states"])
        cache.slot_counter.copy_(tensors["slot_counter"])
        cache.slot_document.copy_(tensors["slot_document"])
        cache.written = int(meta["written"])
        return cache
