"""Perceiver AR (Hawthorne et al. 2022) and the three enhancements of Mahmood & Huang (V1, V2, V3).

Of the T input positions the last l = min(latent, T) are the latent, the T - l before them the
history. Only latent positions are queries of the top layer, so `forward` returns logits for them
alone: [B, l, V], the predictions made at positions T-l ... T-1 (training and held-out scores align
targets to the end). A shorter input moves the split, so unlike a plain decoder the output at a
position depends on where the input ends; causality is the perturbation kind: for a fixed input
length, no output moves when a later token changes.

Every layer here has a latent attention: latent queries over [context; latent], the context all
visible (it precedes every latent position) and the latent part causal. The explicit boolean mask is
aligned to the end of the keys: SDPA's `is_causal` would align it to the start, wrong whenever there
are fewer queries than keys.

- perceiver-ar: the first layer's context is the embedded history; later layers have none (causal
  self-attention over the latent).
- perceiver-ar-v1: the history is carried through every layer: each layer's context is the history
  stream, which has its own self-attention (own weights, no mask: no prediction is made at a history
  position, and all of it precedes every query that predicts); the MLP runs on both streams. The
  last layer's history update would reach no output, so that layer has none (nor its weights).
- perceiver-ar-v2: as v1, with the history attention only within segments of `history_segment`
  positions, counted from the start.
- perceiver-ar-v3: the first layer maps the history to `history_compressed` positions by a learned
  [p, h_max] matrix along the sequence (h_max = max_seq_len - latent; a shorter history uses the last
  h columns, as if zeros stood to its left); that stream is carried like v1's history. Its positions
  for rotary are spread evenly over the history they summarise, the last at h-1. The paper's
  equations 14-21 apply "to all layers including the first", so the first layer's latent attends to
  the compressed history, not to the raw one; that reading is the one built here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.rope import apply_rope
from research.lms.lm_common import LanguageModel, LMConfig, blocked_attention, merge_heads, qkv_heads, rope_angles

VARIANTS = ("perceiver-ar", "perceiver-ar-v1", "perceiver-ar-v2", "perceiver-ar-v3")


def history_length(config: LMConfig) -> int:
    return config.max_seq_len - config.latent


def latent_mask(n_context: int, n_latent: int, device: torch.device) -> torch.Tensor:
    """[l, n_context + l]: True where a latent query may look."""
    rows = torch.arange(n_latent, device=device).view(-1, 1)
    cols = torch.arange(n_context + n_latent, device=device).view(1, -1)
    return cols - n_context <= rows


def rotate(x: torch.Tensor, at: torch.Tensor, config: LMConfig) -> torch.Tensor:
    cos, sin = rope_angles(at, config.head_dim, config.rope_base)
    return apply_rope(x, cos, sin)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment: int) -> torch.Tensor:
    """Unmasked attention within consecutive segments of `segment` positions (the last may be short)."""
    B, H, n, hd = q.shape
    pad = -n % segment
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    shape = (B, H, (n + pad) // segment, segment, hd)
    real = (torch.arange(n + pad, device=q.device) < n).view(-1, segment)  # keys that are not padding
    mask = real[:, None, :]  # n_segments, 1, s: broadcast over the rows of a segment
    out = blocked_attention(q.view(shape), k.view(shape), v.view(shape), mask)
    return out.reshape(B, H, n + pad, hd)[:, :, :n]


class PerceiverAttention(nn.Module):
    """One layer's latent attention, and (v1-v3) its history attention with separate weights."""

    kernel = "auto"  # unused: plain SDPA everywhere (kept so `use_kernel` applies to every family)

    def __init__(self, config: LMConfig, history: str) -> None:
        super().__init__()
        self.config, self.history = config, history  # history: "none", "full" or "segments"
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.out = nn.Linear(config.dim, config.dim, bias=False)
        if history != "none":
            self.history_qkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
            self.history_out = nn.Linear(config.dim, config.dim, bias=False)

    def forward(
        self, context: torch.Tensor, latent: torch.Tensor, context_at: torch.Tensor, latent_at: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Normed streams [B, n, C] and their rotary positions [n]; returns the updates of both
        (None for the history when this layer has no history attention)."""
        cfg = self.config
        n = context.shape[1]
        C = cfg.dim
        split = lambda t: t.view(*t.shape[:2], cfg.n_heads, -1).transpose(1, 2)  # noqa: E731  # B, H, n, hd
        q = split(F.linear(latent, self.qkv.weight[:C]))  # no query projection for the context rows
        k, v = map(split, F.linear(torch.cat([context, latent], dim=1), self.qkv.weight[C:]).split(C, dim=-1))
        q, k = rotate(q, latent_at, cfg), rotate(k, torch.cat([context_at, latent_at]), cfg)
        mask = latent_mask(n, latent.shape[1], latent.device)
        latent_out = self.out(merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))
        if self.history == "none" or n == 0:
            return None, latent_out
        hq, hk, hv = qkv_heads(context, self.history_qkv, cfg.n_heads)
        hq, hk = rotate(hq, context_at, cfg), rotate(hk, context_at, cfg)
        if self.history == "segments":
            history_out = segment_attention(hq, hk, hv, cfg.history_segment)
        else:
            history_out = F.scaled_dot_product_attention(hq, hk, hv)
        return self.history_out(merge_heads(history_out)), latent_out


class PerceiverAR(LanguageModel):
    """The embeddings, norms and MLPs of `LanguageModel`; its own forward over two streams."""

    def __init__(self, config: LMConfig, arch: str) -> None:
        if arch not in VARIANTS:
            raise ValueError(f"unknown Perceiver AR variant {arch!r}; choose one of {VARIANTS}")
        history = {"perceiver-ar-v1": "full", "perceiver-ar-v2": "segments", "perceiver-ar-v3": "full"}.get(arch, "none")
        layer = iter(range(config.n_layers))  # the factory is called once per layer, in order
        # the last layer's history update would reach nothing: it has only the latent attention
        super().__init__(config, lambda c: PerceiverAttention(c, history if next(layer) < c.n_layers - 1 else "none"), arch)
        if arch == "perceiver-ar-v3":
            if history_length(config) < 1:
                raise ValueError("perceiver-ar-v3 needs max_seq_len > latent (a history to compress)")
            h_max = history_length(config)
            self.compress = nn.Parameter(torch.randn(config.history_compressed, h_max) * h_max**-0.5)

    def _context(self, history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first layer's context stream and its rotary positions."""
        h = history.shape[1]
        at = torch.arange(h, device=history.device)
        if self.arch != "perceiver-ar-v3" or h == 0:
            return history, at
        if h > self.compress.shape[1]:
            raise ValueError(f"history of {h} positions; perceiver-ar-v3 compresses at most {self.compress.shape[1]}")
        p, h_max = self.compress.shape
        compressed = torch.einsum("ph,bhc->bpc", self.compress[:, -h:], history)
        at = (torch.arange(1, p + 1, device=history.device) * h_max) // p - 1 - (h_max - h)
        return compressed, at

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, min(latent, T), V] for the last positions."""
        T = input_ids.shape[1]
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence of {T} tokens; the model takes at most {self.config.max_seq_len}")
        x = self.embed(input_ids)
        h = max(0, T - self.config.latent)
        context, context_at = self._context(x[:, :h])
        latent, latent_at = x[:, h:], torch.arange(h, T, device=x.device)
        for block in self.layers:
            attn: Any = block.attn
            n = context.shape[1]
            normed = block.attn_norm(torch.cat([context, latent], dim=1))
            context_update, latent_update = attn(normed[:, :n], normed[:, n:], context_at, latent_at)
            latent = latent + latent_update
            if context_update is None:  # the baseline: the history ends with the first layer's attention
                context, context_at, n = context[:, :0], context_at[:0], 0
            else:
                context = context + context_update
            streams = torch.cat([context, latent], dim=1)
            streams = streams + block.mlp(block.mlp_norm(streams))
            context, latent = streams[:, :n], streams[:, n:]
        return self.norm(latent) @ self.embed.weight.T


def build_perceiver_ar(config: LMConfig, arch: str) -> LanguageModel:
    return PerceiverAR(config, arch)
