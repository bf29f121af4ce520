"""Projections that read the same input run as one matmul: a decoder layer's q, k and v, and its
MLP's gate and up (the batched decode step, engine/batching.py).

A decode step's matmul of a few rows costs a call, a cast of its input (bf16 and int8 weights) and
a pass over its weights; one call for q, k and v saves two calls and two casts a layer, and one
for gate and up saves one of each. The parts' weights become row blocks (views) of the fused
weight, so fusing adds no memory and the model's own modules (a prompt's prefill, the other
memories' passes) compute exactly as before. Fuse after the model is on its device and in its
dtype: a later `.to()` would move the parts and leave the fused weights behind. The same parts
fused again get the same fused layer, so each model holds its weights once however many decoders
step it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from engine.models.quantize import WeightOnlyLinear

_FUSED: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, ...], nn.Module]] = weakref.WeakKeyDictionary()


def fuse_linears(parts: Sequence[nn.Module | None]) -> nn.Module | None:
    """One linear layer whose output is the `parts`' outputs side by side; None when they cannot
    be fused (other module types, such as an adapter's LoRA layer, or mixed kinds or biases)."""
    known = _FUSED.get(parts[0]) if parts and parts[0] is not None else None
    if known is not None and known[0] == tuple(id(part) for part in parts):
        return known[1]
    fused = _fuse(parts)
    if fused is not None:
        _FUSED[cast(nn.Module, parts[0])] = (tuple(id(part) for part in parts), fused)
    return fused


def _fuse(parts: Sequence[nn.Module | None]) -> nn.Module | None:
    kinds = {type(part) for part in parts}
    if len(parts) < 2 or len(kinds) != 1 or kinds.isdisjoint({nn.Linear, WeightOnlyLinear}):
        return None
    linears = cast(list[nn.Linear | WeightOnlyLinear], list(parts))
    if len({part.in_features for part in linears}) != 1 or len({part.bias is None for part in linears}) != 1:
        return None
    if kinds == {nn.Linear}:
        return _fused_plain(cast(list[nn.Linear], linears))
    return WeightOnlyLinear.fused(cast(list[WeightOnlyLinear], linears))


def _fused_plain(parts: list[nn.Linear]) -> nn.Linear:
    weight = torch.cat([part.weight.detach() for part in parts])
    fused = nn.Linear(parts[0].in_features, weight.shape[0], bias=parts[0].bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    _rebind(parts, "weight", weight)
    if parts[0].bias is not None:
        bias = torch.cat([part.bias.detach() for part in parts if part.bias is not None])
        fused.bias = nn.Parameter(bias, requires_grad=False)
        _rebind(parts, "bias", bias)
    return fused


def _rebind(parts: Sequence[nn.Module], name: str, whole: torch.Tensor) -> None:
    """Make each part's parameter `name` the rows of `whole` it holds (as a view)."""
    sizes = [getattr(part, name).shape[0] for part in parts]
    for part, view in zip(parts, whole.split(sizes), strict=True):
        requires_grad = getattr(part, name).requires_grad
        setattr(part, name, nn.Parameter(view, requires_grad=requires_grad))
