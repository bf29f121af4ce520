"""Attention over a key/value cache of past segments, selected per token ("Accurate and Efficient
Attention with a Key-Value Cache", ../shared/papers/kv-cache-segment-selection.md).

The text is cut into segments of l tokens (`segment_len`). The queries of segment c attend to:
- the short-term memory: the m tokens before the segment (`memory_len`, a multiple of l), and the
  segment itself causally: Transformer-XL's recurrence, which one batched pass computes exactly;
- the cache: the N segments before the memory (`cache_segments`; FIFO, so segments c-M-N ... c-M-1
  with M = m / l). Each cached segment has a key; each token scores the keys, takes the softmax over
  the cache and keeps the top k (`cache_top_k`). The k segments' keys and values join the token's
  softmax in every layer, their values multiplied by the segment's weight α (the paper's eq. 5-6;
  α is applied after the value projection, which equals the paper's weighting of the cached states
  before it, and survives the pre-norm, which would cancel a weight put on the states).

The causal form. The paper builds each token's query from a first pass of the same layers over the
memory and the current segment (its eq. 4): the top-layer output at the token, built from tokens up to
it and never from later tokens of its segment. Here that first pass runs without the cache, over the
whole sequence at once. A segment's key is the same first pass's output at the segment's last token,
so keys and queries share one space. (Keys from the second pass's top layer, as the paper writes,
would make segment c's key depend on the selection made inside segment c: a recurrence across
segments, which one batched pass cannot compute.) A cached segment ends before the memory starts,
so no selection can reach a token after the query.

Gradients: the paper stops them at memory and cache because it trains one segment after another; a
one-pass batch holds the whole graph, so they flow here (forward values are the same).

Also unlike the paper: selection scores are scaled by 1/sqrt(d_model) before the softmax (the paper
writes a plain q·K, whose softmax saturates at this width), and positions are rotary (the paper
uses Transformer-XL's learned relative embeddings).

`SegmentCacheStream` feeds a text of any length a chunk at a time against a bounded state (the last
M + N segments' keys and values per layer, the first pass's last m, and N + M segment keys); its
logits equal the one-pass forward's (tests/research/test_research_families.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.rope import apply_rope
from research.lms.lm_common import LanguageModel, LMConfig, blocked_attention, merge_heads, positions, qkv_heads, rope_angles


@dataclass
class Picks:
    """Each token's selected segments: indices, weights α and validity, each [B, T, k]."""

    index: torch.Tensor
    weight: torch.Tensor
    valid: torch.Tensor


CACHE_PATHS = ("window", "gather")


def check_config(config: LMConfig) -> None:
    if config.memory_len % config.segment_len:
        raise ValueError("segment-cache needs memory_len to be a multiple of segment_len")
    if not 1 <= config.cache_top_k <= config.cache_segments:
        raise ValueError("segment-cache needs 1 <= cache_top_k <= cache_segments")


def cache_range(segment: torch.Tensor, config: LMConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """First and last cached segment (inclusive) for queries in `segment`; empty when last < max(first, 0)."""
    last = segment - config.memory_len // config.segment_len - 1
    return last - config.cache_segments + 1, last


def select(queries: torch.Tensor, keys: torch.Tensor, first_key: int, rows_at: torch.Tensor, config: LMConfig) -> Picks:
    """queries [B, n, C] at positions rows_at [n]; keys [B, S, C] of segments first_key ... ."""
    k = config.cache_top_k
    scores = queries @ keys.transpose(-1, -2) * queries.shape[-1] ** -0.5  # B, n, S
    first, last = cache_range(rows_at // config.segment_len, config)
    segment = torch.arange(keys.shape[1], device=keys.device) + first_key
    visible = (segment >= first.view(-1, 1)) & (segment <= last.view(-1, 1))  # n, S
    scores = F.pad(scores.masked_fill(~visible, float("-inf")), (0, max(0, k - keys.shape[1])), value=float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with nothing cached: all zero
    top, index = scores.topk(k, dim=-1)
    valid = top.isfinite()
    return Picks(torch.where(valid, index + first_key, 0), weights.gather(-1, index) * valid, valid)


class SegmentCacheAttention(nn.Module):
    kernel = "auto"  # unused: plain tensors (kept so `use_kernel` applies to every family)
    cache_path = "window"  # CACHE_PATHS: how the picked segments are attended (same function)

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        check_config(config)
        self.config = config
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.out = nn.Linear(config.dim, config.dim, bias=False)

    def heads(self, x: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (rotated at start ...) and v: [B, H, n, hd]."""
        q, k, v = qkv_heads(x, self.qkv, self.config.n_heads)
        cos, sin = rope_angles(positions(x.shape[1], x.device) + start, self.config.head_dim, self.config.rope_base)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, picks: Picks | None) -> torch.Tensor:
        """x [B, T, C] normed; without picks, memory and segment only (the query pass)."""
        cfg = self.config
        B, T, _ = x.shape
        l, m = cfg.segment_len, cfg.memory_len
        q, k, v = self.heads(x, 0)
        S = -(-T // l)
        q, k, v = (F.pad(t, (0, 0, 0, S * l - T)) for t in (q, k, v))  # padding after every real query
        H, hd = q.shape[1], q.shape[3]
        windows = lambda t: F.pad(t, (0, 0, m, 0)).unfold(2, m + l, l).transpose(-1, -2)  # noqa: E731  # B, H, S, m+l, hd
        rows = q.view(B, H, S, l, hd)
        key_at = torch.arange(S, device=x.device).view(-1, 1, 1) * l - m + torch.arange(m + l, device=x.device)  # S, 1, m+l
        row_at = torch.arange(S * l, device=x.device).view(S, l, 1)
        mask = (key_at <= row_at) & (key_at >= 0)  # S, l, m+l
        if picks is None:
            out = blocked_attention(rows, windows(k), windows(v), mask)
        elif self.cache_path == "window":
            out = self._with_cache_window(rows, k, v, mask, picks)
        else:
            out = self._with_cache(rows, windows(k), windows(v), mask, k, v, picks)
        return self.out(merge_heads(out.reshape(B, H, S * l, hd)[:, :, :T]))

    def _with_cache_window(self, rows, k, v, mask, picks: Picks) -> torch.Tensor:  # noqa: ANN001
        """The same softmax over one contiguous window per segment: its N cache segments, memory and
        itself. Unpicked cache keys are masked, picked ones' probabilities scaled by α: exact, and
        plain matrix products, at a cost that grows with N * l (the gather path's does not)."""
        cfg = self.config
        l, N = cfg.segment_len, cfg.cache_segments
        B, H, S, _, hd = rows.shape
        span = N * l + cfg.memory_len + l
        windows = lambda t: F.pad(t, (0, 0, span - l, 0)).unfold(2, span, l).transpose(-1, -2)  # noqa: E731  # B, H, S, span, hd
        slot = picks.index - cache_range(positions(picks.index.shape[1], rows.device) // l, cfg)[0].view(1, -1, 1)  # B, T, k
        alpha = rows.new_zeros(B, picks.index.shape[1], N + 1)  # slot N: where invalid picks land
        alpha.scatter_(-1, torch.where(picks.valid, slot, N), picks.weight * picks.valid)
        picked = rows.new_zeros(B, picks.index.shape[1], N + 1, dtype=torch.bool)
        picked.scatter_(-1, torch.where(picks.valid, slot, N), picks.valid)
        pad = S * l - picks.index.shape[1]
        alpha, picked = (F.pad(t[..., :N], (0, 0, 0, pad)).repeat_interleave(l, dim=-1) for t in (alpha, picked.to(torch.uint8)))
        full_mask = torch.cat([picked.bool().view(B, 1, S, l, -1), mask.expand(B, 1, *mask.shape)], dim=-1)
        scores = (rows @ windows(k).transpose(-1, -2)).masked_fill(~full_mask, float("-inf"))
        weights = torch.softmax(scores * hd**-0.5, dim=-1)
        scale = torch.cat([alpha.view(B, 1, S, l, -1), alpha.new_ones(B, 1, S, l, span - N * l)], dim=-1)
        return (weights * scale) @ windows(v)

    def _with_cache(self, rows, k_win, v_win, mask, k, v, picks: Picks) -> torch.Tensor:  # noqa: ANN001
        """One softmax over each row's memory, segment and k cached segments."""
        l = self.config.segment_len
        B, H, S, _, hd = rows.shape
        pad = S * l - picks.index.shape[1]
        index, weight = F.pad(picks.index, (0, 0, 0, pad)), F.pad(picks.weight, (0, 0, 0, pad))
        valid = F.pad(picks.valid.to(torch.uint8), (0, 0, 0, pad)).bool()
        b = torch.arange(B, device=rows.device).view(B, 1, 1, 1)
        h = torch.arange(H, device=rows.device).view(1, H, 1, 1)
        by_segment = lambda t: t.view(B, H, S, l, hd)[b, h, index[:, None]].view(B, H, S, l, -1, hd)  # noqa: E731
        k_cache, v_cache = by_segment(k), by_segment(v)  # B, H, S, l, k*l, hd: each row's picked segments
        local = (rows @ k_win.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
        cached = (k_cache @ rows.unsqueeze(-1)).squeeze(-1)  # B, H, S, l, k*l
        cached = cached.masked_fill(~valid.repeat_interleave(l, dim=-1).view(B, 1, S, l, -1), float("-inf"))
        weights = torch.softmax(torch.cat([local, cached], dim=-1) * hd**-0.5, dim=-1)
        n_local = k_win.shape[3]
        alpha = weight.repeat_interleave(l, dim=-1).view(B, 1, S, l, -1)  # each cached value scaled by its segment's α
        out = weights[..., :n_local] @ v_win
        return out + ((weights[..., n_local:] * alpha).unsqueeze(-2) @ v_cache).squeeze(-2)


class SegmentCacheLM(LanguageModel):
    def __init__(self, config: LMConfig) -> None:
        super().__init__(config, SegmentCacheAttention, "segment-cache")

    def use_cache_path(self, path: str) -> SegmentCacheLM:
        """ "window" (default): one window of N cached segments, memory and segment per query segment,
        unpicked keys masked: fastest for small N. "gather": each row's k picked segments copied out,
        a cost that does not grow with N (the paper's efficiency claim)."""
        if path not in CACHE_PATHS:
            raise ValueError(f"unknown cache path {path!r}; choose one of {CACHE_PATHS}")
        for block in self.blocks:
            block.attn.cache_path = path  # type: ignore[union-attr]
        return self

    def run(self, x: torch.Tensor, picks: Picks | None) -> torch.Tensor:
        """The blocks over embeddings x [B, T, C]; returns the normed top layer."""
        for block in self.layers:
            x = x + block.attn(block.attn_norm(x), picks)
            x = x + block.mlp(block.mlp_norm(x))
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T, l = input_ids.shape[1], self.config.segment_len
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence of {T} tokens; the model takes at most {self.config.max_seq_len}")
        x = self.embed(input_ids)
        queries = self.run(x, None)
        keys = queries[:, l - 1 : (T // l) * l : l]  # each complete segment's last token
        picks = select(queries, keys, 0, positions(T, x.device), self.config)
        return self.run(x, picks) @ self.embed.weight.T


def build_segment_cache(config: LMConfig) -> LanguageModel:
    return SegmentCacheLM(config)
