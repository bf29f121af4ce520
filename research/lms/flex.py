"""Fused attention for Long-Short and CacheFormer through `flex_attention`.

The joint softmax of a query runs over its window, the compressed keys of the segments that end
before it, and its group's cached segments. All of these are rows of two tensors the layer already
has: the compressed keys [S*r] and the window-normed keys of every position [T]. So the fused path
makes one key sequence of the two and describes each query's softmax by a mask function: no key is
gathered or copied per group, and on CUDA `torch.compile` turns the call into one kernel that never
materialises the scores and skips blocks the mask rules out.

A cached segment may also lie inside the query's window. The plain path then has that key twice
in its softmax; twice the same key is the key once with ln 2 added to its score, which is what
`score_mod` adds, so both paths compute the same function.

Flex attention has no backward pass on CPU and runs unfused there unless compiled, so the default
on CPU is the plain tensor path; `kernel="flex"` forces this one (tests check it equals the plain
path, and bench/bench_lm_scaling.py times both).

The compiled CUDA kernel needs heads of at least 16 numbers (torch 2.11 refuses 8 when lowering);
smaller heads are padded with zeros, which changes no score (q·k) and adds only zero columns to
the output, cut off again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

KERNELS = ("auto", "math", "flex")
MIN_HEAD_DIM = 16

_compiled: dict[str, Any] = {}


def uses_flex(kernel: str, x: torch.Tensor) -> bool:
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {KERNELS}")
    return kernel == "flex" or (kernel == "auto" and x.is_cuda)


def compile_kernels(enabled: bool = True) -> None:
    """Compile flex attention for every device (CUDA always compiles; on CPU this is opt-in,
    inference only)."""
    _compiled["all"] = torch.compile(flex_attention, dynamic=False) if enabled else None


def _kernel(device: torch.device) -> Callable[..., Any]:
    if _compiled.get("all") is not None:
        return _compiled["all"]
    if device.type != "cuda":
        return flex_attention
    if "cuda" not in _compiled:
        _compiled["cuda"] = torch.compile(flex_attention, dynamic=False)
    return _compiled["cuda"]


Mod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, copies: Mod, scale: float) -> torch.Tensor:
    """q [B, H, L, hd], k and v [B, H, N, hd]; copies(b, h, q_idx, kv_idx) -> how many times key
    kv_idx enters query q_idx's softmax (0: masked). Rows that see no key get zeros."""
    B, H, L, _ = q.shape

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return copies(b, h, q_idx, kv_idx) > 0

    def score_mod(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return score + torch.log(copies(b, h, q_idx, kv_idx).clamp_min(1).to(score.dtype))

    block_mask = create_block_mask(mask_mod, B, H, L, k.shape[2], device=q.device, _compile=q.is_cuda)
    head_dim, pad = q.shape[-1], max(0, MIN_HEAD_DIM - q.shape[-1])
    if pad:
        q, k, v = (torch.nn.functional.pad(t, (0, pad)) for t in (q, k, v))
    out = _kernel(q.device)(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)
    return out[..., :head_dim] if pad else out
