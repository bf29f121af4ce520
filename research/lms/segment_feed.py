"""The segment feed of the Long-Short and CacheFormer LMs: a text of any length goes through the
model a chunk at a time, against a per-session state of its past segments.

Per layer the state holds what the one-pass forward would compute for the past:
- every past token's window key and value (normed, rotated): the sliding window reads the last
  w-1 of them, and cache attention fetches whole past segments from them, uncompressed;
- the compressed keys and values of every completed segment, and of the overlap segments;
- the raw keys and values of the tokens not yet in a completed segment;
- the running sums of cache-selection scores over the rows of the current and previous group.

Cache attention's top-k lookup reuses the long-attention scores: every query already scores every
compressed key, and the model's relevance (the mean |q·k̄| of a segment) is read off them, so the
lookup is exact and costs no extra pass. Feeding a text in chunks of any size gives the logits
of one forward pass over it (tests/research/test_segment_feed.py). Positions keep counting past the training
length: beyond it the model runs where it was never trained, under the same equations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F

from research.lms.lm_common import LanguageModel, qkv_heads
from research.lms.long_short import LongShortAttention
from research.lms.segments import compress, select_segments

CHUNK = 128  # query rows per pass: bounds the [heads, rows, past segments] score tensors


class Growable:
    """An append-only [H, N, hd] buffer: `reserve` makes room for what a feed will add (one copy,
    counted before it happens); a rollback truncates it and keeps its room."""

    def __init__(self, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.data = torch.empty(heads, 0, head_dim, dtype=dtype, device=device)
        self.n = 0

    def reserve(self, rows: int) -> None:
        """Room for `rows` rows in all, allocated exactly (the old buffer is freed after the copy)."""
        if rows > self.data.shape[1]:
            grown = self.data.new_empty(self.data.shape[0], rows, self.data.shape[2])
            grown[:, : self.n] = self.data[:, : self.n]
            self.data = grown

    def reserve_bytes(self, rows: int) -> int:
        """What `reserve(rows)` allocates."""
        return rows * self.row_bytes if rows > self.data.shape[1] else 0

    def append(self, x: torch.Tensor) -> None:
        self.reserve(self.n + x.shape[1])  # a no-op after the feed's reserve
        self.data[:, self.n : self.n + x.shape[1]] = x
        self.n += x.shape[1]

    def replace(self, x: torch.Tensor) -> None:
        self.data, self.n = x.clone(), x.shape[1]

    def trim(self) -> None:
        """Give back the room past the rows held (one copy)."""
        if self.data.shape[1] > self.n:
            self.replace(self.view())

    def view(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return self.data[:, start : self.n if stop is None else stop]

    @property
    def row_bytes(self) -> int:
        return self.data.shape[0] * self.data.shape[2] * self.data.element_size()

    @property
    def nbytes(self) -> int:
        """What it holds in memory: its room, used or not."""
        return self.data.shape[1] * self.row_bytes


@dataclass
class LayerState:
    window_k: Growable  # every past token, normed and rotated: [H, N, hd]
    window_v: Growable
    long_k: Growable  # compressed segments, r rows each: [H, S*r, hd]
    long_v: Growable
    overlap_k: Growable  # compressed segments shifted by l/2
    overlap_v: Growable
    raw_k: torch.Tensor  # [H, m, hd] raw keys of positions raw_start ... N-1
    raw_v: torch.Tensor
    raw_start: int = 0
    previous_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [H, S] group before the current
    current_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [H, S] current group so far

    def growables(self) -> tuple[Growable, ...]:
        return self.window_k, self.window_v, self.long_k, self.long_v, self.overlap_k, self.overlap_v

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {name: g.view().clone() for name, g in zip(GROWABLE_NAMES, self.growables(), strict=True)}
        return {
            **named,
            "raw_k": self.raw_k.clone(),
            "raw_v": self.raw_v.clone(),
            "previous_sum": self.previous_sum.clone(),
            "current_sum": self.current_sum.clone(),
            "raw_start": torch.tensor(self.raw_start),
        }

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, g in zip(GROWABLE_NAMES, self.growables(), strict=True):
            g.replace(tensors[name])
        self.raw_k, self.raw_v = tensors["raw_k"].clone(), tensors["raw_v"].clone()
        self.previous_sum, self.current_sum = tensors["previous_sum"].clone(), tensors["current_sum"].clone()
        self.raw_start = int(tensors["raw_start"])


GROWABLE_NAMES = ("window_k", "window_v", "long_k", "long_v", "overlap_k", "overlap_v")


@dataclass(frozen=True)
class Mark:
    """Where a state stood; `FeedState.rollback` returns to it."""

    length: int
    layers: tuple[tuple[tuple[int, ...], torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor], ...]


class FeedState:
    """One session's past, for one model. Not thread-safe: the model's worker owns it."""

    def __init__(self, model: LanguageModel) -> None:
        cfg = model.config
        param = next(model.parameters())
        H, hd = cfg.n_heads, cfg.head_dim

        def layer() -> LayerState:
            grow = lambda: Growable(H, hd, param.dtype, param.device)  # noqa: E731
            empty = param.new_zeros(H, 0, hd)
            sums = param.new_zeros(H, 0)
            return LayerState(grow(), grow(), grow(), grow(), grow(), grow(), empty, empty, 0, sums, sums)

        self.config = cfg
        self.length = 0
        self.layers = [layer() for _ in range(cfg.n_layers)]

    @property
    def nbytes(self) -> int:
        per_layer = (sum(g.nbytes for g in s.growables()) + s.raw_k.nbytes * 2 for s in self.layers)
        return sum(per_layer)

    def _rows_after(self, tokens: int) -> tuple[int, ...]:
        """Rows each growable of a layer holds once `tokens` more are fed: a window row a token,
        r compressed rows a completed segment (the overlap segments start l/2 later)."""
        cfg = self.config
        end, l, r = self.length + tokens, cfg.segment_len, cfg.compressed_per_segment
        window, long, overlap = end, r * (end // l), r * max(0, (end - l // 2) // l) if cfg.overlap else 0
        return window, window, long, long, overlap, overlap

    def reserve(self, tokens: int) -> None:
        """Room for feeding `tokens` more, made at once, so that the feed itself copies nothing."""
        rows = self._rows_after(tokens)
        for layer in self.layers:
            for g, n in zip(layer.growables(), rows, strict=True):
                g.reserve(n)

    def trim(self) -> None:
        """Give back every store's room past the rows it holds."""
        for layer in self.layers:
            for g in layer.growables():
                g.trim()

    def reserve_bytes(self, tokens: int) -> int:
        """What `reserve(tokens)` allocates."""
        rows = self._rows_after(tokens)
        return sum(g.reserve_bytes(n) for layer in self.layers for g, n in zip(layer.growables(), rows, strict=True))

    def mark(self) -> Mark:
        layers = tuple(
            (tuple(g.n for g in s.growables()), s.raw_k, s.raw_v, s.raw_start, s.previous_sum, s.current_sum) for s in self.layers
        )
        return Mark(self.length, layers)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of the state under flat names (safetensors-ready), plus its length."""
        flat = {f"{i}.{name}": t for i, layer in enumerate(self.layers) for name, t in layer.tensors().items()}
        return {**flat, "length": torch.tensor(self.length)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for i, layer in enumerate(self.layers):
            prefix = f"{i}."
            layer.load({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)})
        self.length = int(state["length"])

    def rollback(self, mark: Mark) -> None:
        """Forget everything fed since `mark` (tensors are replaced, never written in place, so the
        mark's references still hold the old values)."""
        self.length = mark.length
        for s, (sizes, raw_k, raw_v, raw_start, previous, current) in zip(self.layers, mark.layers, strict=True):
            for g, n in zip(s.growables(), sizes, strict=True):
                g.n = n
            s.raw_k, s.raw_v, s.raw_start, s.previous_sum, s.current_sum = raw_k, raw_v, raw_start, previous, current


def check_feedable(model: LanguageModel) -> None:
    if not isinstance(model.blocks[0].attn, LongShortAttention):
        raise ValueError(f"only long-short and cacheformer models take a segment feed; this one is {model.arch!r}")


@torch.inference_mode()
def feed(model: LanguageModel, state: FeedState, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
    """Run `token_ids` after everything the state holds; returns their logits [n, V] and keeps them."""
    check_feedable(model)
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=next(model.parameters()).device).view(-1)
    state.reserve(len(ids))
    outputs = []
    for start in range(0, len(ids), CHUNK):
        x = model.embed(ids[start : start + CHUNK])[None]  # 1, n, C
        position = state.length
        blocks: list[Any] = list(model.blocks)
        for block, layer in zip(blocks, state.layers, strict=True):
            x = x + _attend(block.attn, layer, block.attn_norm(x), position)
            x = x + block.mlp(block.mlp_norm(x))
        state.length += x.shape[1]
        outputs.append(model.norm(x)[0] @ model.embed.weight.T)
    return torch.cat(outputs) if outputs else ids.new_zeros(0, model.config.vocab_size, dtype=torch.float)


def _attend(attn: LongShortAttention, layer: LayerState, x: torch.Tensor, position: int) -> torch.Tensor:
    """One layer's attention for rows at `position` ... `position + n - 1`, updating its state."""
    cfg = attn.config
    n = x.shape[1]
    q, k, v = (t[0] for t in qkv_heads(x, attn.qkv, cfg.n_heads))  # H, n, hd
    rows = torch.arange(position, position + n, device=x.device)
    q = attn._rope(q, rows)
    layer.window_k.append(attn._rope(attn.window_norm_k(k), rows))
    layer.window_v.append(attn.window_norm_v(v))
    _compress_completed(attn, layer, k, v, position)
    scale = cfg.head_dim**-0.5
    first = max(0, position - cfg.window + 1)
    keys = torch.arange(first, position + n, device=x.device)
    s_window = (q @ layer.window_k.view(first).transpose(-1, -2)) * scale  # H, n, nw
    in_window = (keys.view(1, -1) <= rows.view(-1, 1)) & (keys.view(1, -1) > rows.view(-1, 1) - cfg.window)
    s_window = s_window.masked_fill(~in_window, float("-inf"))
    r, l = cfg.compressed_per_segment, cfg.segment_len
    S = layer.long_k.n // r
    ends = (torch.arange(S, device=x.device) + 1) * l - 1
    s_long = (q @ layer.long_k.view().transpose(-1, -2)) * scale  # H, n, S*r
    visible = ends.view(1, -1) < rows.view(-1, 1)  # n, S
    parts = [s_window, s_long.masked_fill(~visible.repeat_interleave(r, dim=1), float("-inf"))]
    values = [layer.window_v.view(first), layer.long_v.view()]
    cached = _cached_segments(attn, layer, q, s_long, visible, rows) if cfg.cache_top_k else None
    if cached is not None:
        parts.append(cached[0])
    weights = torch.softmax(torch.cat(parts, dim=-1), dim=-1).split([p.shape[-1] for p in parts], dim=-1)
    out = weights[0] @ values[0] + weights[1] @ values[1]
    if cached is not None:
        out = out + (weights[2].unsqueeze(-2) @ cached[1]).squeeze(-2)
    if cfg.overlap:
        out = out + _overlap(attn, layer, q, rows)
    return attn.out(out.transpose(0, 1).reshape(1, n, cfg.dim))


def _compress_completed(attn: LongShortAttention, layer: LayerState, k: torch.Tensor, v: torch.Tensor, position: int) -> None:
    """Append the raw keys/values, compress every segment now complete, keep only the unfinished tail."""
    cfg = attn.config
    l, r = cfg.segment_len, cfg.compressed_per_segment
    layer.raw_k, layer.raw_v = torch.cat([layer.raw_k, k], dim=1), torch.cat([layer.raw_v, v], dim=1)
    end = position + k.shape[1]
    compressions: list[tuple[Growable, Growable, torch.Tensor, int]] = [(layer.long_k, layer.long_v, attn.compress_proj, 0)]
    if cfg.overlap:
        compressions.append((layer.overlap_k, layer.overlap_v, cast(torch.Tensor, attn.overlap_proj), l // 2))
    keep_from = end
    for keys, values, proj, offset in compressions:
        done = keys.n // r  # segments compressed so far
        start = offset + done * l
        complete = max(0, (end - start) // l)
        if complete:
            lo = start - layer.raw_start
            k_bar, v_bar = compress(
                layer.raw_k[None, :, lo : lo + complete * l], layer.raw_v[None, :, lo : lo + complete * l], proj, l
            )
            seg_ends = offset + (torch.arange(done, done + complete, device=k.device) + 1) * l - 1
            k_bar = attn._rope(attn.long_norm_k(k_bar[0]), seg_ends.view(-1, 1))  # H, c, r, hd
            keys.append(k_bar.flatten(1, 2))
            values.append(attn.long_norm_v(v_bar[0]).flatten(1, 2))
        keep_from = min(keep_from, offset + (done + complete) * l)
    drop = max(0, keep_from - layer.raw_start)
    if drop:  # a copy of the tail, so that the longer buffer it was cut from is freed
        layer.raw_k, layer.raw_v, layer.raw_start = (
            layer.raw_k[:, drop:].clone(),
            layer.raw_v[:, drop:].clone(),
            layer.raw_start + drop,
        )


def _group_sums(layer: LayerState, row_scores: torch.Tensor, rows: torch.Tensor, p: int) -> torch.Tensor:
    """Score sums [H, Gc, S] of the group before each group the rows touch; carries the running sums."""
    H, n, S = row_scores.shape
    g0 = int(rows[0]) // p
    local = row_scores.new_zeros(H, int(rows[-1]) // p - g0 + 1, S).index_add_(1, rows // p - g0, row_scores)
    pad = lambda t: F.pad(t, (0, S - t.shape[-1]))  # noqa: E731 - rows before saw none of the newer segments
    local[:, 0] += pad(layer.current_sum)
    before = torch.cat([pad(layer.previous_sum).unsqueeze(1), local[:, :-1]], dim=1)
    if (int(rows[-1]) + 1) % p == 0:  # the last group is complete
        layer.previous_sum, layer.current_sum = local[:, -1], row_scores.new_zeros(H, S)
    else:
        layer.previous_sum = local[:, -2] if local.shape[1] > 1 else pad(layer.previous_sum)
        layer.current_sum = local[:, -1]
    return before


def _cached_segments(
    attn: LongShortAttention,
    layer: LayerState,
    q: torch.Tensor,
    s_long: torch.Tensor,
    visible: torch.Tensor,
    rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores [H, n, K'*l] (masked) and values [H, n, K'*l, hd] of each row's selected segments."""
    cfg = attn.config
    p, l, r = cfg.group_size, cfg.segment_len, cfg.compressed_per_segment
    H, n, _ = q.shape
    S = visible.shape[1]
    row_scores = s_long.abs().view(H, n, S, r).mean(-1) * visible  # H, n, S: mean |q·k̄| per segment
    if p == 1:
        scores, starts, group_of_row = row_scores, rows, torch.arange(n, device=q.device)
    else:
        scores = _group_sums(layer, row_scores, rows, p) / p
        first_group = int(rows[0]) // p
        starts = (torch.arange(scores.shape[1], device=q.device) + first_group) * p
        group_of_row = rows // p - first_group
    ends = (torch.arange(S, device=q.device) + 1) * l - 1
    indices, valid = select_segments(scores[None], ends, starts, cfg.cache_top_k, cfg.cache_neighbours)
    keys = _gather_segments(layer.window_k, indices[0], l)[:, group_of_row]  # H, n, K'l, hd
    values = _gather_segments(layer.window_v, indices[0], l)[:, group_of_row]
    mask = valid[0].repeat_interleave(l, dim=-1)[:, group_of_row]  # H, n, K'l
    s_cache = (keys @ q.unsqueeze(-1)).squeeze(-1) * cfg.head_dim**-0.5
    return s_cache.masked_fill(~mask, float("-inf")), values


def _gather_segments(store: Growable, indices: torch.Tensor, segment_len: int) -> torch.Tensor:
    """Segments `indices` [H, G, K'] of a store, uncompressed: [H, G, K'*l, hd]. Gathers rows in
    place; never copies the store."""
    H, G, K = indices.shape
    rows = (indices.unsqueeze(-1) * segment_len + torch.arange(segment_len, device=indices.device)).view(H, -1, 1)
    picked = store.data.gather(1, rows.expand(-1, -1, store.data.shape[2]))  # H, G*K*l, hd
    return picked.view(H, G, K * segment_len, store.data.shape[2])


def _overlap(attn: LongShortAttention, layer: LayerState, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The overlap segments' own softmax; rows that see none of them add zero."""
    cfg = attn.config
    l, r = cfg.segment_len, cfg.compressed_per_segment
    S = layer.overlap_k.n // r
    ends = l // 2 + (torch.arange(S, device=q.device) + 1) * l - 1
    visible = (ends.view(1, -1) < rows.view(-1, 1)).repeat_interleave(r, dim=1)  # n, S*r
    scores = (q @ layer.overlap_k.view().transpose(-1, -2)) * cfg.head_dim**-0.5
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    return weights @ layer.overlap_v.view()
