"""The parts of a Llama-family causal LM that the engine steps itself (engine/models/llama_step.py,
engine/memories/kvcache/select.py), as types: `nn.Module` attributes otherwise read as `Tensor | Module`."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class Attention(Protocol):
    """A decoder layer's attention."""

    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    scaling: float


class NormedAttention(Attention, Protocol):
    """Qwen3's attention: each head's queries and keys normalised before rotary."""

    q_norm: nn.Module
    k_norm: nn.Module


class Layer(Protocol):
    """A decoder layer."""

    self_attn: Attention
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module


class Backbone(Protocol):
    """A causal LM's `model`: embeddings, rotary embedding, layers, final norm."""

    embed_tokens: nn.Embedding
    rotary_emb: nn.Module
    layers: nn.ModuleList
    norm: nn.Module


RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")  # weight * x / sqrt(mean(x^2) + eps)


def rms_norm_parts(norm: nn.Module, widen: bool = False) -> tuple[torch.Tensor, float] | None:
    """A float32 Llama-family RMSNorm's weight and epsilon, or None for any other norm (or dtype,
    whose module rounds between its two products). `widen`: a bfloat16 norm's weight too, as a
    float32 copy, for a caller that computes the norm in float32 (the C step)."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if type(norm).__name__ not in RMS_NORMS or not isinstance(weight, torch.Tensor) or not isinstance(eps, float):
        return None
    if weight.dtype == torch.float32:
        return weight, eps
    return (weight.float(), eps) if widen and weight.dtype == torch.bfloat16 else None
