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


def _project(out, n_heads, n, query):
    """out(the heads' outputs side by side) [n, C], where query(h, i) is head h's output for row i."""
    heads = torch.stack([torch.stack([query(h, i) for i in range(n)]) for h in range(n_heads)])  # H, n, hd
    return out(heads.transpose(0, 1).reshape(n, -1))


def llp_attention(module, x):
    """x [B, T, C]: query t sees keys from the start of the half before its own up to t."""
    return torch.stack([_llp_row(module, row) for row in x])


def _llp_row(module, row):
    cfg = module.config
    half = cfg.segment_len // 2
    q, k, v = _heads(module.qkv, row, cfg)

    def query(h, t):
        first = max(0, (t // half - 1) * half)
        keys = torch.stack([_rope(cfg, k[h, j], j) for j in range(first, t + 1)])
        return _attend(_rope(cfg, q[h, t], t), keys, v[h, first : t + 1])

    return _project(module.out, cfg.n_heads, row.shape[0], query)


def perceiver_attention(module, context, latent, context_at, latent_at):
    """The latent attention (all context, latent causally) and the history attention (all of it, or
    its own segment), for batch rows of normed streams."""
    latent_outs = [_perceiver_latent_row(module, c, r, context_at, latent_at) for c, r in zip(context, latent, strict=True)]
    if module.history == "none" or context.shape[1] == 0:
        return None, torch.stack(latent_outs)
    return torch.stack([_perceiver_history_row(module, c, context_at) for c in context]), torch.stack(latent_outs)


def _perceiver_latent_row(module, c_row, l_row, context_at, latent_at):
    cfg = module.config
    n = c_row.shape[0]
    at = [int(a) for a in torch.cat([context_at, latent_at])]
    _, k, v = _heads(module.qkv, torch.cat([c_row, l_row]), cfg)
    q = _heads(module.qkv, l_row, cfg).__next__()

    def query(h, i):
        seen = n + i + 1
        keys = torch.stack([_rope(cfg, k[h, j], at[j]) for j in range(seen)])
        return _attend(_rope(cfg, q[h, i], int(latent_at[i])), keys, v[h, :seen])

    return _project(module.out, cfg.n_heads, l_row.shape[0], query)


def _perceiver_history_row(module, c_row, context_at):
    cfg = module.config
    n, s = c_row.shape[0], cfg.history_segment
    q, k, v = _heads(module.history_qkv, c_row, cfg)

    def query(h, i):
        span = range((i // s) * s, min(n, (i // s + 1) * s)) if module.history == "segments" else range(n)
        keys = torch.stack([_rope(cfg, k[h, j], int(context_at[j])) for j in span])
        return _attend(_rope(cfg, q[h, i], int(context_at[i])), keys, v[h, list(span)])

    return _project(module.history_out, cfg.n_heads, n, query)


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
    return torch.stack([_segment_cache_row(module, row, picks[b] if picks is not None else None) for b, row in enumerate(x)])


def _segment_cache_row(module, row, picks):
    cfg = module.config
    l, m = cfg.segment_len, cfg.memory_len
    q, k, v = _heads(module.qkv, row, cfg)

    def query(h, t):
        span = list(range(max(0, (t // l) * l - m), t + 1))
        weights = [1.0] * len(span)
        for segment, weight in picks[t] if picks is not None else []:
            span += list(range(segment * l, (segment + 1) * l))
            weights += [weight] * l
        keys = torch.stack([_rope(cfg, k[h, j], j) for j in span])
        weight_t = torch.stack([torch.as_tensor(w, dtype=row.dtype) for w in weights])
        return _attend(_rope(cfg, q[h, t], t), keys, v[h, span], weight_t)

    return _project(module.out, cfg.n_heads, row.shape[0], query)


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
