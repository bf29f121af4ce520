"""Plain causal decoder: rotary positions, pre-norm, full causal attention (the reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.rope import apply_rope
from research.lms.lm_common import LanguageModel, LMConfig, merge_heads, positions, qkv_heads, rope_angles


class CausalAttention(nn.Module):
    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.config = config
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.out = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv_heads(x, self.qkv, self.config.n_heads)  # B, H, T, hd
        cos, sin = rope_angles(positions(x.shape[1], x.device), self.config.head_dim, self.config.rope_base)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.out(merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


def build_transformer(config: LMConfig) -> LanguageModel:
    return LanguageModel(config, CausalAttention, "transformer")
