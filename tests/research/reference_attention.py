"""A slow, loop-by-loop Long-Short / CacheFormer attention written straight from the rules, to check
the batched implementation against. Only for tests."""

from __future__ import annotations

import math

import torch

from engine.models.rope import apply_rope
from research.lms.lm_common import merge_heads, qkv_heads, rope_angles
from research.lms.long_short import padded_length


def _rope(module, x, position):
    cos, sin = rope_angles(torch.tensor(position), module.config.head_dim, module.config.rope_base)
    return apply_rope(x, cos, sin)


def _segments(module, k, v, proj, offset):
    cfg = module.config
    l = cfg.segment_len
    out = []
    s = 0
    while offset + (s + 1) * l <= k.shape[0]:
        K, V = k[offset + s * l : offset + (s + 1) * l], v[offset + s * l : offset + (s + 1) * l]
        P = torch.softmax(K @ proj, dim=0)  # l, r
        end = offset + (s + 1) * l - 1
        out.append((_rope(module, module.long_norm_k(P.T @ K), end), module.long_norm_v(P.T @ V), end, s))
        s += 1
    return out


def _selection(module, qr, segs, group):
    cfg = module.config
    p, hd = cfg.group_size, cfg.head_dim
    rows = [group] if p == 1 else list(range((group - 1) * p, group * p)) if group > 0 else []
    scores = {}
    for kb, _, end, s in segs:
        if end >= group * p:
            continue
        per_row = [float((qr[t] @ kb.T).abs().mean()) / math.sqrt(hd) if end < t else 0.0 for t in rows]
        scores[s] = sum(per_row) / p if rows else 0.0
    picks = sorted(scores, key=lambda s: -scores[s])[: cfg.cache_top_k]
    u = cfg.cache_neighbours
    chosen = set()
    for s in picks:
        for offset in range(-((u - 1) // 2), u // 2 + 1):
            if s + offset in scores:  # exists and ends before the group
                chosen.add(s + offset)
    return sorted(chosen)


def reference_forward(module, x):
    cfg = module.config
    B, T, C = x.shape
    Tp = padded_length(T, cfg)
    xp = torch.nn.functional.pad(x, (0, 0, 0, Tp - T))
    q, k, v = qkv_heads(xp, module.qkv, cfg.n_heads)
    out = torch.zeros_like(q)
    l, w, hd = cfg.segment_len, cfg.window, cfg.head_dim
    for b in range(B):
        for h in range(cfg.n_heads):
            qr = torch.stack([_rope(module, q[b, h, t], t) for t in range(Tp)])
            kw = torch.stack([_rope(module, module.window_norm_k(k[b, h, t]), t) for t in range(Tp)])
            vw = torch.stack([module.window_norm_v(v[b, h, t]) for t in range(Tp)])
            segs = _segments(module, k[b, h], v[b, h], module.compress_proj, 0)
            overlap = _segments(module, k[b, h], v[b, h], module.overlap_proj, l // 2) if cfg.overlap else []
            for t in range(Tp):
                keys = [kw[j] for j in range(max(0, t - w + 1), t + 1)]
                vals = [vw[j] for j in range(max(0, t - w + 1), t + 1)]
                for kb, vb, end, _ in segs:
                    if end < t:
                        keys += list(kb)
                        vals += list(vb)
                if cfg.cache_top_k:
                    for s in _selection(module, qr, segs, t // cfg.group_size):
                        keys += [kw[j] for j in range(s * l, (s + 1) * l)]
                        vals += [vw[j] for j in range(s * l, (s + 1) * l)]
                weights = torch.softmax(torch.stack(keys) @ qr[t] / math.sqrt(hd), dim=0)
                out[b, h, t] = weights @ torch.stack(vals)
                seen = [(kb, vb) for kb, vb, end, _ in overlap if end < t]
                if seen:
                    K = torch.cat([kb for kb, _ in seen])
                    V = torch.cat([vb for _, vb in seen])
                    out[b, h, t] += torch.softmax(K @ qr[t] / math.sqrt(hd), dim=0) @ V
    return module.out(merge_heads(out))[:, :T]
