"""Slow, one-query-at-a-time attentions of the segment-cache, Perceiver AR and LLP layers, written
straight from their rules, to check the batched code against. Only for tests."""

from __future__ import annotations

import math

import torch

from engine.models.rope import apply_rope
from research.lms.lm_common import rope_angles


def _rope(config, x, position):
    cos, sin = rope_angles(torch.tensor(position), config.head_dim, config.rope_base)
    return apply_rope(x, cos, sin)


def _heads(proj, x, config):
    """x [n, C] -> q, k, v [H, n, hd]."""
    q, k, v = proj(x).split(config.dim, dim=-1)
    return (t.view(x.shape[0], config.n_heads, -1).transpose(0, 1) for t in (q, k, v))


def _attend(q, keys, values, weights=None):
    """One query [hd] over keys [n, hd]; `weights` scale each value."""
    scores = keys @ q / math.sqrt(q.shape[-1])
    p = torch.softmax(scores, dim=0)
    if weights is not None:
        values = values * weights[:, None]
    return p @ values


def llp_attention(module, x):
    """x [B, T, C]: query t sees keys from the start of the half before its own up to t."""
    cfg = module.config
    half = cfg.segment_len // 2
    outs = []
    for row in x:
        q, k, v = _heads(module.qkv, row, cfg)
        T = row.shape[0]
        heads = []
        for h in range(cfg.n_heads):
            rows = []
            for t in range(T):
                first = max(0, (t // half - 1) * half)
                keys = torch.stack([_rope(cfg, k[h, j], j) for j in range(first, t + 1)])
                rows.append(_attend(_rope(cfg, q[h, t], t), keys, v[h, first : t + 1]))
            heads.append(torch.stack(rows))
        outs.append(module.out(torch.stack(heads).transpose(0, 1).reshape(T, -1)))
    return torch.stack(outs)


def perceiver_attention(module, context, latent, context_at, latent_at):
    """The latent attention (all context, latent causally) and the history attention (all of it, or
    its own segment), for batch rows of normed streams."""
    cfg = module.config
    n = context.shape[1]
    latent_outs, history_outs = [], []
    for c_row, l_row in zip(context, latent, strict=True):
        both = torch.cat([c_row, l_row])
        at = [int(a) for a in torch.cat([context_at, latent_at])]
        _, k, v = _heads(module.qkv, both, cfg)
        q = _heads(module.qkv, l_row, cfg).__next__()
        heads = []
        for h in range(cfg.n_heads):
            rows = []
            for i in range(l_row.shape[0]):
                seen = n + i + 1
                keys = torch.stack([_rope(cfg, k[h, j], at[j]) for j in range(seen)])
                rows.append(_attend(_rope(cfg, q[h, i], int(latent_at[i])), keys, v[h, :seen]))
            heads.append(torch.stack(rows))
        latent_outs.append(module.out(torch.stack(heads).transpose(0, 1).reshape(l_row.shape[0], -1)))
        if module.history == "none" or n == 0:
            continue
        hq, hk, hv = _heads(module.history_qkv, c_row, cfg)
        heads = []
        for h in range(cfg.n_heads):
            rows = []
            for i in range(n):
                if module.history == "segments":
                    s = cfg.history_segment
                    span = range((i // s) * s, min(n, (i // s + 1) * s))
                else:
                    span = range(n)
                keys = torch.stack([_rope(cfg, hk[h, j], int(context_at[j])) for j in span])
                rows.append(_attend(_rope(cfg, hq[h, i], int(context_at[i])), keys, hv[h, list(span)]))
            heads.append(torch.stack(rows))
        history_outs.append(module.history_out(torch.stack(heads).transpose(0, 1).reshape(n, -1)))
    return (torch.stack(history_outs) if history_outs else None), torch.stack(latent_outs)


def segment_picks(queries, config):
    """For each row [B, T, C] position t: the cached segments (those ending before the memory, at
    most N of them), softmax over their key scores, the top k: list of (segment, weight) per row."""
    l, M, N = config.segment_len, config.memory_len // config.segment_len, config.cache_segments
    out = []
    for row in queries:
        picks: list[list[tuple[int, torch.Tensor]]] = []
        for t in range(row.shape[0]):
            c = t // l
            cached = [j for j in range(c - M - N, c - M) if j >= 0]
            if not cached:
                picks.append([])
                continue
            scores = torch.stack([row[t] @ row[(j + 1) * l - 1] for j in cached]) / math.sqrt(row.shape[-1])
            weights = torch.softmax(scores, dim=0)
            order = sorted(range(len(cached)), key=lambda i: -float(scores[i]))[: config.cache_top_k]
            picks.append([(cached[i], weights[i]) for i in order])
        out.append(picks)
    return out


def segment_cache_attention(module, x, picks):
    """x [B, T, C] normed; picks from `segment_picks` (or None: memory and segment only)."""
    cfg = module.config
    l, m = cfg.segment_len, cfg.memory_len
    outs = []
    for b, row in enumerate(x):
        q, k, v = _heads(module.qkv, row, cfg)
        T = row.shape[0]
        heads = []
        for h in range(cfg.n_heads):
            rows = []
            for t in range(T):
                span = list(range(max(0, (t // l) * l - m), t + 1))
                weights = [1.0] * len(span)
                for segment, weight in picks[b][t] if picks is not None else []:
                    span += list(range(segment * l, (segment + 1) * l))
                    weights += [weight] * l
                keys = torch.stack([_rope(cfg, k[h, j], j) for j in span])
                weight_t = torch.stack([torch.as_tensor(w, dtype=x.dtype) for w in weights])
                rows.append(_attend(_rope(cfg, q[h, t], t), keys, v[h, span], weight_t))
            heads.append(torch.stack(rows))
        outs.append(module.out(torch.stack(heads).transpose(0, 1).reshape(T, -1)))
    return torch.stack(outs)


def perceiver_forward(model, ids):
    """The whole Perceiver AR forward from the slow attention: split, (v3) compression written out
    position by position, the two streams layer by layer, logits of the latent."""
    cfg = model.config
    T = ids.shape[1]
    h = max(0, T - cfg.latent)
    x = model.embed(ids)
    context, context_at = x[:, :h], torch.arange(h)
    if model.arch == "perceiver-ar-v3" and h:
        p, h_max = model.compress.shape
        rows = [sum(model.compress[i, h_max - h + j] * x[:, j] for j in range(h)) for i in range(p)]
        context = torch.stack(rows, dim=1)
        context_at = torch.tensor([(i + 1) * h_max // p - 1 - (h_max - h) for i in range(p)])
    latent, latent_at = x[:, h:], torch.arange(h, T)
    for block in model.blocks:
        n = context.shape[1]
        normed = block.attn_norm(torch.cat([context, latent], dim=1))
        update, latent_update = perceiver_attention(block.attn, normed[:, :n], normed[:, n:], context_at, latent_at)
        latent = latent + latent_update
        if update is None:
            context, context_at, n = context[:, :0], context_at[:0], 0
        else:
            context = context + update
        both = torch.cat([context, latent], dim=1)
        both = both + block.mlp(block.mlp_norm(both))
        context, latent = both[:, :n], both[:, n:]
    return model.norm(latent) @ model.embed.weight.T
