"""A session's key/value store for segment-selection attention (engine/memories/kvcache/select.py).

The fed document's keys (before rotary) and values, for every layer and key/value head:

- the first `sinks` tokens, kept apart (every query attends to them);
- then segments of `segment_len` tokens, written into fixed-size pages (allocation is by page,
  so the bytes a document adds are known before it is fed), in bfloat16, float32, or int8
  with one scale per segment and channel;
- the last, incomplete segment, kept in the compute dtype until it fills;
- a summary per segment and head that selection scores queries against: the segment's mean key
  (CacheFormer's pooled segment) or its `representatives` keys that drew the largest attention
  logits from the queries of the chunk that wrote them.

`mark`/`rollback` undo everything written after a mark, so a failed ingestion leaves the
documents before it exactly as they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

PAGE_TOKENS = 1024  # tokens a page holds (rounded to whole segments)
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int8": torch.int8}


@dataclass(frozen=True)
class StoreShape:
    layers: int
    kv_heads: int
    head_dim: int
    sinks: int
    segment_len: int
    representatives: int  # summary rows per segment (1 for the mean key)
    storage: str  # a STORAGE_DTYPES key

    @property
    def page_segments(self) -> int:
        return max(1, PAGE_TOKENS // self.segment_len)

    def page_bytes(self) -> int:
        """Keys, values (and int8 scales) of one page, all layers."""
        element = torch.empty((), dtype=STORAGE_DTYPES[self.storage]).element_size()
        rows = self.page_segments * self.segment_len * self.kv_heads * self.head_dim
        scales = 2 * self.page_segments * self.kv_heads * self.head_dim * 4 if self.storage == "int8" else 0
        return self.layers * (2 * rows * element + scales)

    def summary_bytes(self, segments: int) -> int:
        return self.layers * segments * self.representatives * self.kv_heads * self.head_dim * 4

    def bytes_per_token(self) -> int:
        """Stored bytes one document token costs, pages and summaries (sinks and the partial tail aside)."""
        per_segment = self.page_bytes() / self.page_segments + self.summary_bytes(1)
        return int(per_segment / self.segment_len + 0.5)


class KVStore:
    """Keys/values of the documents one session has fed; see the module docstring."""

    def __init__(self, shape: StoreShape, *, device: torch.device, dtype: torch.dtype) -> None:
        self.shape, self.device, self.dtype = shape, device, dtype
        L, H, D = shape.layers, shape.kv_heads, shape.head_dim
        empty = torch.zeros(0, H, D, device=device, dtype=dtype)
        self.sink_k, self.sink_v = [empty] * L, [empty] * L  # [s, H, D] each
        self.tail_k, self.tail_v = [empty] * L, [empty] * L  # the incomplete segment [< l, H, D]
        self.pages: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(L)]
        self.summaries = [torch.zeros(0, shape.representatives, H, D, device=device) for _ in range(L)]
        self.query_mean: list[torch.Tensor | None] = [None] * L  # [H, D] of the last chunk fed
        self.tokens = 0  # fed tokens written
        self.segments = 0  # complete segments

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        pages = len(self.pages[0]) * self.shape.page_bytes()
        small = sum(t.numel() * t.element_size() for t in (*self.sink_k, *self.sink_v, *self.tail_k, *self.tail_v))
        return pages + self.shape.summary_bytes(self.summaries[0].shape[0]) + small

    def added_bytes(self, tokens: int) -> int:
        """An upper bound on what `reserve(tokens)` and writing `tokens` more tokens allocate: new pages,
        a new summary tensor (the old one is kept until commit) and a full tail."""
        segments = (self.tokens + tokens) // self.shape.segment_len + 1
        pages = -(-segments // self.shape.page_segments) - len(self.pages[0])
        sinks = min(max(0, self.shape.sinks - self.tokens), tokens)
        row = 2 * self.shape.layers * self.shape.kv_heads * self.shape.head_dim * self.dtype.itemsize  # a token's key + value
        return (
            max(0, pages) * self.shape.page_bytes() + self.shape.summary_bytes(segments) + (self.shape.segment_len + sinks) * row
        )

    def reserve(self, tokens: int) -> None:
        """Room in the summaries for `tokens` more tokens (a new tensor; `rollback` restores the old)."""
        need = (self.tokens + tokens) // self.shape.segment_len + 1
        for i, old in enumerate(self.summaries):
            if old.shape[0] < need:
                grown = torch.zeros(need, *old.shape[1:], device=self.device)
                grown[: self.segments] = old[: self.segments]
                self.summaries[i] = grown

    def trim(self) -> None:
        """Give back summary rows reserved beyond the segments written (after a commit)."""
        self.summaries = [s if s.shape[0] == self.segments else s[: self.segments].clone() for s in self.summaries]

    # ---- writing -----------------------------------------------------------------------------

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, attention_logits: torch.Tensor | None) -> None:
        """Append one chunk's keys/values [T, H, D] (before rotary) of one layer; `attention_logits`
        [T, H] rank keys for representative summaries. `advance(T)` follows once every layer wrote."""
        taken = min(max(0, self.shape.sinks - self.tokens), keys.shape[0])
        if taken:
            self.sink_k[layer] = torch.cat([self.sink_k[layer], keys[:taken]])
            self.sink_v[layer] = torch.cat([self.sink_v[layer], values[:taken]])
        k = torch.cat([self.tail_k[layer], keys[taken:]])
        v = torch.cat([self.tail_v[layer], values[taken:]])
        logits = None
        if attention_logits is not None:
            held = self.tail_k[layer].shape[0]  # the tail's logits: from this chunk's queries too
            logits = torch.cat([attention_logits.new_zeros(held, attention_logits.shape[1]), attention_logits[taken:]])
            if held:  # the tail was written by the chunk before: rank it by that chunk's mean query
                tail_q = self.query_mean[layer]
                logits[:held] = torch.einsum("thd,hd->th", self.tail_k[layer].float(), tail_q) if tail_q is not None else 0
        l = self.shape.segment_len
        full = k.shape[0] // l
        for j in range(full):
            rows = slice(j * l, (j + 1) * l)
            self._put_segment(layer, self.segments + j, k[rows], v[rows], None if logits is None else logits[rows])
        self.tail_k[layer] = k[full * l :].clone()
        self.tail_v[layer] = v[full * l :].clone()

    def advance(self, tokens: int, query_mean: list[torch.Tensor]) -> None:
        """Every layer wrote a chunk of `tokens`: move the counters; `query_mean` [H, D] per layer is
        kept for the next chunk's selection."""
        before = max(0, self.tokens - self.shape.sinks)
        self.tokens += tokens
        after = max(0, self.tokens - self.shape.sinks)
        self.segments += after // self.shape.segment_len - before // self.shape.segment_len
        self.query_mean = list(query_mean)

    def _put_segment(self, layer: int, index: int, k: torch.Tensor, v: torch.Tensor, logits: torch.Tensor | None) -> None:
        page, slot = divmod(index, self.shape.page_segments)
        if page == len(self.pages[layer]):
            self.pages[layer].append(self._new_page())
        target = self.pages[layer][page]
        if self.shape.storage == "int8":
            for name, x in (("k", k), ("v", v)):
                scale = x.float().abs().amax(dim=0).clamp_min(1e-8) / 127.0  # H, D: per channel
                target[name][slot] = torch.round(x.float() / scale).to(torch.int8)
                target[name + "_scale"][slot] = scale
        else:
            target["k"][slot], target["v"][slot] = k, v
        self.summaries[layer][index] = self._summary(k, logits)

    def _summary(self, k: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        """[R, H, D]: the mean key, or the R keys with the largest attention logits per head."""
        if logits is None:
            return k.float().mean(dim=0, keepdim=True)
        top = logits.topk(self.shape.representatives, dim=0).indices  # R, H
        return k.float().gather(0, top.unsqueeze(-1).expand(-1, -1, k.shape[-1]))

    def _new_page(self) -> dict[str, torch.Tensor]:
        P, l, H, D = self.shape.page_segments, self.shape.segment_len, self.shape.kv_heads, self.shape.head_dim
        dtype = STORAGE_DTYPES[self.shape.storage]
        page = {name: torch.zeros(P, l, H, D, device=self.device, dtype=dtype) for name in ("k", "v")}
        if self.shape.storage == "int8":
            page.update({name: torch.ones(P, H, D, device=self.device) for name in ("k_scale", "v_scale")})
        return page

    # ---- reading -----------------------------------------------------------------------------

    def segment_rows(self, layer: int, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of segments [n, l, H, D] in the compute dtype."""
        ks, vs = [], []
        P = self.shape.page_segments
        for index in indices:
            page = self.pages[layer][index // P]
            slot = index % P
            if self.shape.storage == "int8":
                ks.append(page["k"][slot].float() * page["k_scale"][slot])
                vs.append(page["v"][slot].float() * page["v_scale"][slot])
            else:
                ks.append(page["k"][slot])
                vs.append(page["v"][slot])
        return torch.stack(ks).to(self.dtype), torch.stack(vs).to(self.dtype)

    def best_key_logits(self, layer: int, segments: int, rows: torch.Tensor) -> torch.Tensor:
        """[H, segments] float32: for each of the first `segments` segments and each head h, the
        largest dot product between any of the segment's stored keys and any row of rows[h]
        ([H, R, D], float32). A page at a time: its keys widened to float32 (int8 times their
        scales), then one matmul a head, reduced to each segment's best before the next page, so
        no [keys, rows] product of the whole store is ever held."""
        H, l, P = self.shape.kv_heads, self.shape.segment_len, self.shape.page_segments
        out = torch.empty(H, segments, device=self.device)
        transposed = rows.transpose(1, 2)  # H, D, R
        for first in range(0, segments, P):
            n = min(P, segments - first)
            page = self.pages[layer][first // P]
            keys = page["k"][:n].float()
            if self.shape.storage == "int8":
                keys = keys * page["k_scale"][:n, None]
            keys = keys.view(n * l, H, -1)
            for h in range(H):
                torch.amax((keys[:, h] @ transposed[h]).view(n, -1), dim=-1, out=out[h, first : first + n])
        return out

    def head_segments(self, layer: int, picks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [H, n·l, D] in the compute dtype: head h's segments picks[h] (n for
        every head) back to back, in the order given. Only those (segment, head) pairs are widened
        from storage; the values are segment_rows' own."""
        H, l, D, P = self.shape.kv_heads, self.shape.segment_len, self.shape.head_dim, self.shape.page_segments
        distinct = sorted({s for segments in picks for s in segments})
        row_of = {s: i for i, s in enumerate(distinct)}
        pairs = torch.tensor([row_of[s] * H + h for h, segments in enumerate(picks) for s in segments], device=self.device)
        located = [(self.pages[layer][s // P], s % P) for s in distinct]
        out = []
        for name in ("k", "v"):
            rows = torch.stack([page[name][slot] for page, slot in located])  # U, l, H, D as stored
            chosen = rows.transpose(1, 2).reshape(-1, l, D).index_select(0, pairs)  # pairs, l, D
            if self.shape.storage == "int8":
                scales = torch.stack([page[f"{name}_scale"][slot] for page, slot in located])  # U, H, D
                chosen = chosen.float() * scales.reshape(-1, 1, D).index_select(0, pairs)
            out.append(chosen.to(self.dtype).view(H, -1, D))
        return out[0], out[1]

    def read(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [end - start, H, D] of fed tokens start..end-1 past the sinks (the
        window); start must be on a segment boundary."""
        l, sinks = self.shape.segment_len, self.shape.sinks
        first, last = (start - sinks) // l, max(0, end - sinks) // l
        k, v = self.segment_rows(layer, list(range(first, last))) if last > first else (None, None)
        parts_k = [] if k is None else [k.flatten(0, 1)]
        parts_v = [] if v is None else [v.flatten(0, 1)]
        parts_k.append(self.tail_k[layer])
        parts_v.append(self.tail_v[layer])
        return torch.cat(parts_k), torch.cat(parts_v)

    # ---- undo and persistence ----------------------------------------------------------------

    def mark(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "segments": self.segments,
            "pages": len(self.pages[0]),
            "sinks": self.sink_k[0].shape[0],
            "tail": (list(self.tail_k), list(self.tail_v)),
            "summaries": list(self.summaries),
            "query_mean": list(self.query_mean),
        }

    def rollback(self, mark: dict[str, Any]) -> None:
        self.tokens, self.segments = mark["tokens"], mark["segments"]
        for i in range(self.shape.layers):
            del self.pages[i][mark["pages"] :]
            self.sink_k[i], self.sink_v[i] = self.sink_k[i][: mark["sinks"]], self.sink_v[i][: mark["sinks"]]
        self.tail_k, self.tail_v = list(mark["tail"][0]), list(mark["tail"][1])
        self.summaries, self.query_mean = list(mark["summaries"]), list(mark["query_mean"])
        self._clear_slots_from(self.segments)

    def _clear_slots_from(self, index: int) -> None:
        """A kept page's slots from segment `index` on as a new page has them: nothing of an aborted
        document stays in memory or reaches a snapshot."""
        page, slot = divmod(index, self.shape.page_segments)
        with torch.inference_mode():  # pages written while feeding are inference tensors
            for layer in range(self.shape.layers):
                if page < len(self.pages[layer]):
                    for name, tensor in self.pages[layer][page].items():
                        tensor[slot:] = 1 if name.endswith("_scale") else 0

    def state_dict(self) -> dict[str, Any]:
        """Used pages only, summaries trimmed to the segments written: a restore is bit-exact."""
        return {
            "tokens": self.tokens,
            "segments": self.segments,
            "sink_k": list(self.sink_k),
            "sink_v": list(self.sink_v),
            "tail_k": list(self.tail_k),
            "tail_v": list(self.tail_v),
            "pages": [list(layer) for layer in self.pages],  # not copied: a snapshot is written at once
            "summaries": [s[: self.segments].clone() for s in self.summaries],
            "query_mean": list(self.query_mean),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["pages"]) != self.shape.layers or (
            state["pages"][0]
            and state["pages"][0][0]["k"].shape[1:] != (self.shape.segment_len, self.shape.kv_heads, self.shape.head_dim)
        ):
            raise ValueError("saved kvcache has another shape")

        def move(t: torch.Tensor | None) -> Any:  # a saved tensor on this store's device (None: no query mean yet)
            return None if t is None else t.to(self.device)

        self.tokens, self.segments = int(state["tokens"]), int(state["segments"])
        self.sink_k, self.sink_v = [move(t) for t in state["sink_k"]], [move(t) for t in state["sink_v"]]
        self.tail_k, self.tail_v = [move(t) for t in state["tail_k"]], [move(t) for t in state["tail_v"]]
        self.pages = [[{name: move(t) for name, t in page.items()} for page in layer] for layer in state["pages"]]
        self.summaries = [move(s) for s in state["summaries"]]
        self.query_mean = [move(q) for q in state["query_mean"]]
