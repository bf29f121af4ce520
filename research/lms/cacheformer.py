"""CacheFormer (Singh & Mahmood): Long-Short attention plus, each switchable on its own,

- overlapping segments: a second compression over segments shifted by l/2, attended separately
  and summed with the long-short output;
- cache attention: each past segment is scored by the magnitude of its r compressed attention
  scores, averaged over a group of p queries; the top-k segments and their neighbours (u in all
  per pick) are fetched uncompressed and join the group's joint softmax.

Causality: a group's selection uses only the rows of the group before it (or the row itself when
p = 1), and only segments that end before the group starts can be picked; duplicates after adding
neighbours are dropped; missing picks are masked, never filled with a later segment.
"""

from __future__ import annotations

import torch
from torch import nn

from research.lms import flex
from research.lms.lm_common import LanguageModel, LMConfig
from research.lms.long_short import LongShortAttention
from research.lms.segments import ends_before_rows, gather_segments, group_scores, select_segments


class CacheFormerAttention(LongShortAttention):
    def __init__(self, config: LMConfig) -> None:
        super().__init__(config)
        hd = config.head_dim
        if config.overlap:
            self.overlap_proj = nn.Parameter(torch.randn(hd, config.compressed_per_segment) * hd**-0.5)

    def select(self, q: torch.Tensor, k_bar: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's picks: segment indices and validity [B, H, G, k*u]."""
        cfg = self.config
        B, H, Tp, hd = q.shape
        p, G = cfg.group_size, Tp // cfg.group_size
        S, r = k_bar.shape[2], k_bar.shape[3]
        flat = (q @ k_bar.reshape(B, H, S * r, hd).transpose(-1, -2)).abs() * hd**-0.5  # B, H, Tp, S*r
        row_scores = flat.view(B, H, Tp, S, r).mean(-1)  # B, H, Tp, S: magnitude of each segment's r scores
        visible = ends.view(1, -1) < torch.arange(Tp, device=q.device).view(-1, 1)  # Tp, S
        scores = group_scores(row_scores * visible, p)  # B, H, G, S
        starts = torch.arange(G, device=q.device) * p
        return select_segments(scores, ends, starts, cfg.cache_top_k, cfg.cache_neighbours)

    def cached_keys(self, q, k_win, v_win, k_bar, ends):  # noqa: ANN001, ANN201
        cfg = self.config
        if cfg.cache_top_k == 0:
            return []
        B, H, Tp, _ = q.shape
        G, l = Tp // cfg.group_size, cfg.segment_len
        indices, valid = self.select(q, k_bar, ends)
        keys = gather_segments(k_win, indices, l)  # B, H, G, K'*l, hd
        values = gather_segments(v_win, indices, l)
        mask = valid.repeat_interleave(l, dim=-1).unsqueeze(3).expand(B, H, G, cfg.group_size, -1)
        return [(keys, values, mask)]

    def chosen_segments(self, q, k_bar, ends):  # noqa: ANN001, ANN201
        if self.config.cache_top_k == 0:
            return None
        indices, valid = self.select(q, k_bar, ends)
        chosen = torch.zeros(*indices.shape[:3], k_bar.shape[2], dtype=torch.int32, device=q.device)
        return chosen.scatter_add_(-1, indices, valid.to(torch.int32)) > 0  # valid picks are distinct

    def extra_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | float:
        cfg = self.config
        if not cfg.overlap:
            return 0.0
        B, H, Tp, hd = q.shape
        k_ov, v_ov, ends = self.compressed(k, v, self.overlap_proj, cfg.segment_len // 2)  # B, H, S', r, hd
        r = cfg.compressed_per_segment
        k_ov, v_ov = k_ov.flatten(2, 3), v_ov.flatten(2, 3)  # B, H, S'*r, hd
        if flex.uses_flex(self.kernel, q):
            if k_ov.shape[2] == 0:
                return 0.0
            ov_ends = ends.repeat_interleave(r)
            return flex.attend(q, k_ov, v_ov, lambda b, h, q_idx, kv_idx: (ov_ends[kv_idx] < q_idx).to(torch.int32), hd**-0.5)
        visible = ends_before_rows(ends.repeat_interleave(r), 1, Tp)[0]  # Tp, S'*r
        scores = (q * hd**-0.5) @ k_ov.transpose(-1, -2)  # B, H, Tp, S'*r
        weights = torch.softmax(scores.masked_fill_(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
        return weights @ v_ov  # rows with nothing visible add zero


def build_cacheformer(config: LMConfig) -> LanguageModel:
    return LanguageModel(config, CacheFormerAttention, "cacheformer")
