"""Transformer-LS causal attention (the Long-Short baseline of CacheFormer).

Short: each query sees a sliding window of w keys (t-w+1 ... t). Long: keys and values are cut into
segments of l tokens and each segment is compressed to r vectors by a dynamic projection; a query
sees the compressed segments that end before it. Window and compressed scores share one softmax.
DualLN: separate LayerNorms on window and compressed keys/values, rotary applied after them;
compressed keys are rotated at their segment's last position, so query-segment scores depend on
relative distance.

Queries are processed in groups of p rows (the unit CacheFormer's cache attention selects for), as
batched tensors: no Python loop over batch, heads, segments or groups.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.rope import apply_rope
from research.lms import flex
from research.lms.lm_common import LanguageModel, LMConfig, merge_heads, qkv_heads, rope_angles
from research.lms.segments import compress, ends_before_rows, segment_ends, window_mask, window_span


def padded_length(T: int, config: LMConfig) -> int:
    unit = math.lcm(config.segment_len, config.group_size)
    return -(-T // unit) * unit


class LongShortAttention(nn.Module):
    kernel = "auto"  # flex.KERNELS: the fused flex path on CUDA, plain tensors on CPU

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.config = config
        hd = config.head_dim
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.out = nn.Linear(config.dim, config.dim, bias=False)
        self.compress_proj = nn.Parameter(torch.randn(hd, config.compressed_per_segment) * hd**-0.5)
        self.window_norm_k, self.window_norm_v = nn.LayerNorm(hd), nn.LayerNorm(hd)
        self.long_norm_k, self.long_norm_v = nn.LayerNorm(hd), nn.LayerNorm(hd)

    def _rope(self, x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_angles(at, self.config.head_dim, self.config.rope_base)
        return apply_rope(x, cos, sin)

    def compressed(self, k: torch.Tensor, v: torch.Tensor, proj: torch.Tensor, offset: int) -> tuple[torch.Tensor, ...]:
        """Normed compressed keys (rotated at segment ends) and values [B, H, S, r, hd], and ends [S]."""
        l = self.config.segment_len
        k_bar, v_bar = compress(k[:, :, offset:], v[:, :, offset:], proj, l)
        ends = segment_ends(k_bar.shape[2], l, offset, k.device)
        k_bar = self._rope(self.long_norm_k(k_bar), ends.view(-1, 1))  # each segment at its last position
        return k_bar, self.long_norm_v(v_bar), ends

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        B, T, C = x.shape
        Tp = padded_length(T, cfg)
        x = F.pad(x, (0, 0, 0, Tp - T))  # padding sits after every real token: no real query sees it
        q, k, v = qkv_heads(x, self.qkv, cfg.n_heads)  # B, H, Tp, hd
        pos = torch.arange(Tp, device=x.device)
        q = self._rope(q, pos)
        k_win = self._rope(self.window_norm_k(k), pos)
        v_win = self.window_norm_v(v)
        k_bar, v_bar, ends = self.compressed(k, v, self.compress_proj, 0)
        out = self.joint_attention(q, k_win, v_win, k_bar, v_bar, ends)  # B, H, Tp, hd
        out = out + self.extra_attention(q, k, v)
        return self.out(merge_heads(out)[:, :T])

    def joint_attention(
        self,
        q: torch.Tensor,
        k_win: torch.Tensor,
        v_win: torch.Tensor,
        k_bar: torch.Tensor,
        v_bar: torch.Tensor,
        ends: torch.Tensor,
    ) -> torch.Tensor:
        """One softmax per query over its window, the compressed segments ending before it, and
        whatever `cached_keys` adds. Scores are joined, not keys: the compressed keys are shared
        by every group and never copied per group."""
        if flex.uses_flex(self.kernel, q):
            return self._joint_flex(q, k_win, v_win, k_bar, v_bar, ends)
        cfg = self.config
        B, H, Tp, hd = q.shape
        p, G, r = cfg.group_size, Tp // cfg.group_size, cfg.compressed_per_segment
        scaled = q * hd**-0.5  # the scores come out scaled: no pass over them to scale
        queries = scaled.view(B, H, G, p, hd)
        k_span, v_span = window_span(k_win, cfg.window, p), window_span(v_win, cfg.window, p)  # B, H, G, p+w-1, hd
        s_window = queries @ k_span.transpose(-1, -2)  # B, H, G, p, p+w-1
        s_window = s_window.masked_fill_(~window_mask(G, p, cfg.window, q.device), float("-inf"))
        S = k_bar.shape[2]
        k_flat, v_flat = k_bar.reshape(B, H, S * r, hd), v_bar.reshape(B, H, S * r, hd)
        s_long = (scaled @ k_flat.transpose(-1, -2)).view(B, H, G, p, S * r)  # B, H, G, p, S*r
        s_long = s_long.masked_fill_(~ends_before_rows(ends.repeat_interleave(r), G, p), float("-inf"))
        extra = self.cached_keys(q, k_win, v_win, k_bar, ends)  # [(keys, values, mask) per group]
        s_extra = [(queries @ k.transpose(-1, -2)).masked_fill_(~m, float("-inf")) for k, _, m in extra]
        sizes = [s_window.shape[-1], S * r, *(s.shape[-1] for s in s_extra)]
        weights = torch.softmax(torch.cat([s_window, s_long, *s_extra], dim=-1), dim=-1).split(sizes, dim=-1)
        out = weights[0] @ v_span  # B, H, G, p, hd
        out = out + (weights[1].reshape(B, H, Tp, S * r) @ v_flat).view(B, H, G, p, hd)
        for w_extra, (_, values, _) in zip(weights[2:], extra, strict=True):
            out = out + w_extra @ values
        return out.reshape(B, H, Tp, hd)

    def _joint_flex(
        self,
        q: torch.Tensor,
        k_win: torch.Tensor,
        v_win: torch.Tensor,
        k_bar: torch.Tensor,
        v_bar: torch.Tensor,
        ends: torch.Tensor,
    ) -> torch.Tensor:
        """The same softmax in one flex call over [compressed keys | every position's window key]."""
        cfg = self.config
        B, H, Tp, hd = q.shape
        n_long = k_bar.shape[2] * cfg.compressed_per_segment
        keys = torch.cat([k_bar.reshape(B, H, n_long, hd), k_win], dim=2)
        values = torch.cat([v_bar.reshape(B, H, n_long, hd), v_win], dim=2)
        long_ends = ends.repeat_interleave(cfg.compressed_per_segment)
        chosen = self.chosen_segments(q, k_bar, ends)  # B, H, G, S or None
        w, l, p = cfg.window, cfg.segment_len, cfg.group_size

        def copies(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            j = (kv_idx - n_long).clamp_min(0)  # the position of an uncompressed key
            own = kv_idx >= n_long
            count = (own & (j <= q_idx) & (j > q_idx - w)).to(torch.int32)
            if n_long:
                count = count + (~own & (long_ends[kv_idx.clamp_max(n_long - 1)] < q_idx)).to(torch.int32)
            if chosen is not None:
                count = count + (own & chosen[b, h, q_idx // p, j // l]).to(torch.int32)
            return count

        return flex.attend(q, keys, values, copies, hd**-0.5)

    def chosen_segments(self, q, k_bar, ends):  # noqa: ANN001, ANN201 - CacheFormer's hook
        """[B, H, G, S] bool: the segments each group attends uncompressed (None: no cache attention)."""
        return None

    def cached_keys(self, q, k_win, v_win, k_bar, ends):  # noqa: ANN001, ANN201 - CacheFormer's hook
        return []

    def extra_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | float:
        return 0.0


def build_long_short(config: LMConfig) -> LanguageModel:
    return LanguageModel(config, LongShortAttention, "long-short")
