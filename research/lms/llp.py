"""LLP, the Long-LoRA-inspired Perceiver (Mahmood & Huang): Perceiver AR over pairs of half segments.

The sequence is cut into halves of s/2 positions (s = `segment_len`). In every layer the queries of
half i attend to the keys of halves i-1 and i: all of half i-1, and half i causally; half 0 has no
predecessor and attends to itself causally (the paper's ATTN block). Every position is a query and
a prediction, so the whole sequence trains. One projection per layer serves the ATTN block and every
pair (the paper's per-block matrices would tie the parameter count to the sequence length), and the
keys and values get no extra norm beyond the block's pre-norm. A query sees s/2 to s
positions back in one layer; each layer above reaches another s/2 further, as in the paper's Fig. 4.

Batched as [B, H, halves, s/2, hd] queries against [B, H, halves, s, hd] key pairs: no loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.rope import apply_rope
from research.lms.lm_common import LanguageModel, LMConfig, blocked_attention, merge_heads, positions, qkv_heads, rope_angles


def pair_mask(n_halves: int, half: int, device: torch.device) -> torch.Tensor:
    """[halves, half, 2 * half]: the previous half (if any) entirely, the current one causally."""
    rows = torch.arange(half, device=device).view(1, -1, 1)
    cols = torch.arange(2 * half, device=device).view(1, 1, -1)
    has_previous = (torch.arange(n_halves, device=device) > 0).view(-1, 1, 1)
    return torch.where(cols < half, has_previous, cols - half <= rows)


class LLPAttention(nn.Module):
    kernel = "auto"  # unused: plain SDPA (kept so `use_kernel` applies to every family)

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        if config.segment_len % 2:
            raise ValueError("llp needs an even segment_len (it works on half segments)")
        self.config = config
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.out = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        B, T, _ = x.shape
        half = cfg.segment_len // 2
        q, k, v = qkv_heads(x, self.qkv, cfg.n_heads)  # B, H, T, hd
        cos, sin = rope_angles(positions(T, x.device), cfg.head_dim, cfg.rope_base)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        pad = -T % half  # padding at the end: after every real query, so never seen
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        n = (T + pad) // half
        H, hd = q.shape[1], q.shape[3]
        halves = lambda t: t.view(B, H, n, half, hd)  # noqa: E731
        before = lambda t: F.pad(halves(t), (0, 0, 0, 0, 1, 0))[:, :, :n]  # noqa: E731  # half i-1 (zeros for half 0)
        keys = torch.cat([before(k), halves(k)], dim=3)  # B, H, n, 2*half, hd
        values = torch.cat([before(v), halves(v)], dim=3)
        out = blocked_attention(halves(q), keys, values, pair_mask(n, half, x.device))
        return self.out(merge_heads(out.reshape(B, H, n * half, hd)[:, :, :T]))


def build_llp(config: LMConfig) -> LanguageModel:
    return LanguageModel(config, LLPAttention, "llp")
