"""Segment helpers for Long-Short and CacheFormer attention: compression, masks, selection.

Positions are 0-based. Segment s of length l covers [offset + s*l, offset + (s+1)*l); it "ends
before" query t when its last position is < t. Queries are handled in groups of p rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compress(k: torch.Tensor, v: torch.Tensor, proj: torch.Tensor, segment_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic projection per segment: P = softmax over the l positions of (K_seg @ proj).

    k, v [B, H, S*l, hd]; proj [hd, r] -> k̄, v̄ [B, H, S, r, hd].
    """
    B, H, T, hd = k.shape
    S = T // segment_len
    k_seg = k[:, :, : S * segment_len].reshape(B, H, S, segment_len, hd)  # B, H, S, l, hd
    v_seg = v[:, :, : S * segment_len].reshape(B, H, S, segment_len, hd)
    weights = torch.softmax(k_seg @ proj, dim=-2)  # B, H, S, l, r (softmax over l)
    return weights.transpose(-1, -2) @ k_seg, weights.transpose(-1, -2) @ v_seg  # B, H, S, r, hd


def segment_ends(n_segments: int, segment_len: int, offset: int, device: torch.device) -> torch.Tensor:
    """Last position of each segment: [S]."""
    return offset + (torch.arange(n_segments, device=device) + 1) * segment_len - 1


def window_span(x: torch.Tensor, window: int, group_size: int) -> torch.Tensor:
    """For each group of p queries, the keys its rows may see in their windows.

    x [B, H, T, hd] with T a multiple of p -> [B, H, G, p + w - 1, hd]; key j of group g is at
    position g*p - (w - 1) + j (negative positions are zero padding, masked by `window_mask`).
    """
    padded = F.pad(x, (0, 0, window - 1, 0))  # B, H, w-1+T, hd
    span = padded.unfold(2, group_size + window - 1, group_size)  # B, H, G, hd, p+w-1
    return span.transpose(-1, -2)


def window_mask(n_groups: int, group_size: int, window: int, device: torch.device) -> torch.Tensor:
    """[G, p, p + w - 1]: row t = g*p + i may see key position j when t-w+1 <= j <= t and j >= 0."""
    g = torch.arange(n_groups, device=device)[:, None, None]
    i = torch.arange(group_size, device=device)[None, :, None]
    j = torch.arange(group_size + window - 1, device=device)[None, None, :]
    t = g * group_size + i
    key = g * group_size - (window - 1) + j
    return (key >= 0) & (key <= t) & (key >= t - window + 1)


def ends_before_rows(ends: torch.Tensor, n_groups: int, group_size: int) -> torch.Tensor:
    """[G, p, len(ends)]: entry e is visible to row t when ends[e] < t."""
    t = torch.arange(n_groups * group_size, device=ends.device).view(n_groups, group_size, 1)
    return ends.view(1, 1, -1) < t


def group_scores(row_scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-group segment relevance [B, H, G, S] from per-row scores [B, H, T, S].

    With p = 1 a row scores its own selection (its query depends on tokens up to itself only).
    With p > 1 group g is scored by the rows of group g-1, so no row's selection depends on a later
    row of its own group; group 0 gets no scores.
    """
    B, H, T, S = row_scores.shape
    grouped = row_scores.view(B, H, T // group_size, group_size, S).mean(dim=3)  # B, H, G, S
    if group_size == 1:
        return grouped
    return torch.cat([torch.zeros_like(grouped[:, :, :1]), grouped[:, :, :-1]], dim=2)


def select_segments(
    scores: torch.Tensor, ends: torch.Tensor, starts: torch.Tensor, top_k: int, neighbours: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k segments per group plus neighbours, only among segments ending before the group starts.

    scores [B, H, G, S] (>= 0), ends [S], starts [G] (each group's first position) -> indices and
    validity [B, H, G, k*u]; duplicates and segments that do not end before the group are marked
    invalid (never a future one).
    """
    B, H, G, S = scores.shape
    allowed = ends.view(1, -1) < starts.view(-1, 1)  # G, S
    masked = scores.masked_fill(~allowed, float("-inf"))
    k = min(top_k, S)
    top, picks = masked.topk(k, dim=-1)  # B, H, G, k
    offsets = torch.arange(-((neighbours - 1) // 2), neighbours // 2 + 1, device=scores.device)  # u
    indices = (picks.unsqueeze(-1) + offsets).flatten(-2)  # B, H, G, k*u
    valid = (top > float("-inf")).unsqueeze(-1).expand(-1, -1, -1, -1, len(offsets)).flatten(-2)
    in_range = (indices >= 0) & (indices < S)
    indices = indices.clamp(0, S - 1)
    valid = valid & in_range & allowed.view(1, 1, G, S).expand(B, H, G, S).gather(-1, indices)
    same = indices.unsqueeze(-1) == indices.unsqueeze(-2)  # B, H, G, K', K'
    earlier_valid = torch.triu(torch.ones(same.shape[-1], same.shape[-1], dtype=torch.bool, device=scores.device), 1).T
    duplicate = (same & earlier_valid & valid.unsqueeze(-2)).any(-1)  # an earlier valid entry holds it
    return indices, valid & ~duplicate


def gather_segments(x: torch.Tensor, indices: torch.Tensor, segment_len: int) -> torch.Tensor:
    """x [B, H, S*l, hd], indices [B, H, G, K'] -> the uncompressed segments [B, H, G, K'*l, hd]."""
    B, H, T, hd = x.shape
    S = T // segment_len
    G, K = indices.shape[2], indices.shape[3]
    segs = x[:, :, : S * segment_len].reshape(B, H, S, segment_len * hd)  # one row per segment
    picked = segs.gather(2, indices.reshape(B, H, G * K, 1).expand(B, H, G * K, segment_len * hd))
    return picked.view(B, H, G, K * segment_len, hd)
