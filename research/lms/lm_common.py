"""Pieces shared by the from-scratch language models: config, rotary embeddings, the block and the LM
shell. Each family supplies its attention module; `build` picks the family by name."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LMConfig:
    vocab_size: int = 256  # bytes
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    max_seq_len: int = 1024
    window: int = 128  # w: short attention sees keys t-w+1 ... t
    segment_len: int = 16  # l
    compressed_per_segment: int = 4  # r per segment (r total = T / l * this)
    overlap: bool = False  # CacheFormer: a second compression over segments shifted by l/2
    cache_top_k: int = 0  # k: uncompressed segments fetched per query group (0: no cache attention)
    cache_neighbours: int = 1  # u: each pick and its u-1 following neighbours
    group_size: int = 32  # p: queries that share one selection
    latent: int = 128  # Perceiver AR: the last `latent` positions are queries (and the only predictions)
    history_segment: int = 64  # perceiver-ar-v2: history attention within segments of this many positions
    history_compressed: int = 32  # perceiver-ar-v3: the history compressed to this many positions
    memory_len: int = 64  # segment-cache: m, the short-term memory before the current segment
    cache_segments: int = 8  # segment-cache: N, past segments held in the cache
    rope_base: float = 10_000.0

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError("dim must be divisible by n_heads")
        positive = ("window", "segment_len", "compressed_per_segment", "group_size", "cache_neighbours", "latent")
        for name in (*positive, "history_segment", "history_compressed", "memory_len", "cache_segments"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.overlap and self.segment_len % 2:
            raise ValueError("overlapping segments need an even segment_len")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_angles(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [..., head_dim] for integer positions [...]."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv  # ..., hd/2
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


class MLP(nn.Module):
    def __init__(self, dim: int, ratio: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, ratio * dim, bias=False)
        self.down = nn.Linear(ratio * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, config: LMConfig, attention: nn.Module) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.dim)
        self.attn = attention
        self.mlp_norm = RMSNorm(config.dim)
        self.mlp = MLP(config.dim, config.mlp_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class LanguageModel(nn.Module):
    """Embeddings, blocks with the family's attention, final norm, tied output head."""

    def __init__(self, config: LMConfig, attention_factory: Any, arch: str) -> None:
        super().__init__()
        self.config, self.arch = config, arch
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(Block(config, attention_factory(config)) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V]."""
        if input_ids.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence of {input_ids.shape[1]} tokens; the model takes at most {self.config.max_seq_len}")
        x = self.embed(input_ids)  # B, T, C
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.T  # B, T, V

    @property
    def layers(self) -> list[Block]:
        """The blocks, typed (a ModuleList yields plain Modules)."""
        return cast(list[Block], list(self.blocks))

    def use_kernel(self, kernel: str) -> LanguageModel:
        """Attention kernel of Long-Short and CacheFormer layers: "auto" (fused flex attention on
        CUDA, plain tensors on CPU), "math" or "flex". The plain transformer always uses SDPA."""
        from research.lms.flex import KERNELS

        if kernel not in KERNELS:
            raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {KERNELS}")
        for block in self.blocks:
            cast(Any, block).attn.kernel = kernel  # every block's attention has a kernel
        return self

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def qkv_heads(x: torch.Tensor, proj: nn.Linear, n_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, C = x.shape
    q, k, v = proj(x).split(C, dim=-1)
    shape = (B, T, n_heads, C // n_heads)
    return (t.view(shape).transpose(1, 2) for t in (q, k, v))  # type: ignore[return-value]  # each B, H, T, hd


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    B, H, T, hd = x.shape
    return x.transpose(1, 2).reshape(B, T, H * hd)


def positions(T: int, device: torch.device) -> torch.Tensor:
    return torch.arange(T, device=device)


def scale_of(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA over blocks: q [B, H, n, L, hd], k and v [B, H, n, S, hd], mask broadcastable to
    [B, H, n, L, S]; run as one 4-D call (CUDA's fused kernels take only 4-D inputs)."""
    B, H, n, L, hd = q.shape
    S = k.shape[-2]
    flat = lambda t: t.reshape(B, H * n, t.shape[-2], hd)  # noqa: E731
    full_mask = mask.expand(B, H, n, L, S).reshape(B, H * n, L, S)
    return F.scaled_dot_product_attention(flat(q), flat(k), flat(v), attn_mask=full_mask).view(B, H, n, L, hd)
