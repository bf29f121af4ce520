"""The segment-cache LM fed a chunk at a time, against a bounded state: per layer the keys and values
of the last M + N segments (memory and cache) and of the first pass's last m tokens, and the keys of
the last N + M segments. Chunks are cut at segment ends; each piece runs the query pass, selects, and
runs the cached pass exactly as the one-pass forward does for its rows, so the logits are equal
(tests/research/test_research_families.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from research.lms.lm_common import merge_heads
from research.lms.segment_cache import Picks, SegmentCacheLM, select


@dataclass
class Keys:
    """One layer's rotated keys and values [H, n, hd] of positions start ... start + n - 1."""

    k: torch.Tensor
    v: torch.Tensor
    start: int = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = torch.cat([self.k, k], dim=1), torch.cat([self.v, v], dim=1)

    def keep_from(self, position: int) -> None:
        drop = max(0, position - self.start)
        self.k, self.v, self.start = self.k[:, drop:], self.v[:, drop:], self.start + drop


class SegmentCacheStream:
    """One text's state for one model. Not thread-safe."""

    def __init__(self, model: SegmentCacheLM) -> None:
        self.model, cfg = model, model.config
        param = next(model.parameters())
        empty = lambda: Keys(param.new_zeros(cfg.n_heads, 0, cfg.head_dim), param.new_zeros(cfg.n_heads, 0, cfg.head_dim))  # noqa: E731
        self.query_layers = [empty() for _ in range(cfg.n_layers)]
        self.layers = [empty() for _ in range(cfg.n_layers)]
        self.segment_keys, self.first_key = param.new_zeros(0, cfg.dim), 0
        self.length = 0

    @property
    def stores(self) -> list[Keys]:
        return [*self.query_layers, *self.layers]

    @property
    def nbytes(self) -> int:
        return sum(s.k.nbytes + s.v.nbytes for s in self.stores) + self.segment_keys.nbytes

    def mark(self) -> tuple[Any, ...]:
        """Where the state stands; `rollback` returns to it (tensors are replaced, never written in place)."""
        return self.length, self.first_key, self.segment_keys, tuple((s.k, s.v, s.start) for s in self.stores)

    def rollback(self, mark: tuple[Any, ...]) -> None:
        self.length, self.first_key, self.segment_keys, stores = mark
        for store, (k, v, start) in zip(self.stores, stores, strict=True):
            store.k, store.v, store.start = k, v, start

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor under a flat name (safetensors-ready)."""
        flat = {f"{i}.{name}": t for i, s in enumerate(self.stores) for name, t in (("k", s.k), ("v", s.v))}
        starts = [s.start for s in self.stores]
        counters = {
            "starts": torch.tensor(starts),
            "first_key": torch.tensor(self.first_key),
            "length": torch.tensor(self.length),
        }
        return {**flat, "segment_keys": self.segment_keys, **counters}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        device = self.segment_keys.device
        for i, store in enumerate(self.stores):
            store.k, store.v, store.start = state[f"{i}.k"].to(device), state[f"{i}.v"].to(device), int(state["starts"][i])
        self.segment_keys = state["segment_keys"].to(device)
        self.first_key, self.length = int(state["first_key"]), int(state["length"])

    def bound_tokens(self) -> tuple[int, int]:
        """The most positions a layer keeps: (cached pass, query pass)."""
        cfg = self.model.config
        return cfg.memory_len + (cfg.cache_segments + 1) * cfg.segment_len, cfg.memory_len + cfg.segment_len

    @torch.inference_mode()
    def feed(self, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Run `token_ids` after everything fed so far; returns their logits [n, V]."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.segment_keys.device).view(-1)
        l, out, i = self.model.config.segment_len, [], 0
        while i < len(ids):
            take = min(len(ids) - i, l - self.length % l)
            out.append(self._piece(ids[i : i + take]))
            i += take
        return torch.cat(out) if out else self.segment_keys.new_zeros(0, self.model.config.vocab_size)

    def _piece(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows inside one segment."""
        model, cfg = self.model, self.model.config
        l, start, n = cfg.segment_len, self.length, len(ids)
        local_from = max(0, (start // l) * l - cfg.memory_len)
        x = model.embed(ids)[None]
        queries = self._blocks(x, self.query_layers, local_from, None)
        ends_segment = (start + n) % l == 0
        if ends_segment:
            self.segment_keys = torch.cat([self.segment_keys, queries[0, -1:]])
        rows_at = torch.arange(start, start + n, device=x.device)
        picks = select(queries, self.segment_keys[None], self.first_key, rows_at, cfg)
        top = self._blocks(x, self.layers, local_from, picks)
        self.length = start + n
        if ends_segment:
            self._trim()
        return (top @ model.embed.weight.T)[0]

    def _blocks(self, x: torch.Tensor, stores: list[Keys], local_from: int, picks: Picks | None) -> torch.Tensor:
        for block, store in zip(self.model.layers, stores, strict=True):
            x = x + self._attend(block, store, block.attn_norm(x), local_from, picks)
            x = x + block.mlp(block.mlp_norm(x))
        return self.model.norm(x)

    def _attend(self, block: Any, store: Keys, x: torch.Tensor, local_from: int, picks: Picks | None) -> torch.Tensor:
        l, start, n = self.model.config.segment_len, self.length, x.shape[1]
        q, k, v = block.attn.heads(x, start)
        q = q[0]  # H, n, hd
        store.append(k[0], v[0])
        keys, values = store.k[:, local_from - store.start :], store.v[:, local_from - store.start :]
        key_at = torch.arange(local_from, start + n, device=x.device)
        rows_at = torch.arange(start, start + n, device=x.device)
        scores = [(q @ keys.transpose(-1, -2)).masked_fill(key_at > rows_at.view(-1, 1), float("-inf"))]
        if picks is not None:
            at = (picks.index[0].unsqueeze(-1) * l + torch.arange(l, device=x.device)).flatten(-2) - store.start
            at = at.clamp(0, store.k.shape[1] - 1)  # invalid picks point anywhere; they are masked
            k_cache = store.k[:, at]  # H, n, k*l, hd
            v_cache = store.v[:, at] * picks.weight[0].repeat_interleave(l, dim=-1)[None, :, :, None]
            cached = torch.einsum("hnd,hnjd->hnj", q, k_cache)
            scores.append(cached.masked_fill(~picks.valid[0].repeat_interleave(l, dim=-1), float("-inf")))
        weights = torch.softmax(torch.cat(scores, dim=-1) * q.shape[-1] ** -0.5, dim=-1)
        out = weights[..., : keys.shape[1]] @ values
        if picks is not None:
            out = out + torch.einsum("hnj,hnjd->hnd", weights[..., keys.shape[1] :], v_cache)
        return block.attn.out(merge_heads(out[None]))

    def _trim(self) -> None:
        """After a complete segment: keep what the next segment's memory and cache can reach."""
        cfg = self.model.config
        l, segment = cfg.segment_len, self.length // cfg.segment_len  # the next segment
        first_cached = segment - cfg.memory_len // l - cfg.cache_segments
        for store in self.layers:
            store.keep_from(first_cached * l)
        for store in self.query_layers:
            store.keep_from(segment * l - cfg.memory_len)
        drop = max(0, first_cached - self.first_key)
        self.segment_keys, self.first_key = self.segment_keys[drop:], self.first_key + drop
