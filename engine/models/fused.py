"""Projections that read the same input run as one matmul: a decoder layer's q, k and v, and its
MLP's gate and up (the batched decode step, engine/models/llama_step.py).

A decode step's matmul of a few rows costs a call, a cast of its input (bf16, int8 and int4 weights) and
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
    out_features = sum(part.out_features for part in linears)
    if kinds == {nn.Linear}:
        fused: nn.Module = nn.Linear(linears[0].in_features, out_features, bias=False, device="meta")
        names: tuple[str, ...] = ("weight", "bias")
    else:
        modes = {cast(WeightOnlyLinear, part).mode for part in linears}
        if len(modes) != 1:
            return None
        fused = WeightOnlyLinear.shell(modes.pop(), linears[0].in_features, out_features)
        names = ("weight_low", "scales", "scales_low", "weight_full", "bias")
    for name in names:
        _share(linears, fused, name)
    return fused


def _share(parts: Sequence[nn.Module], fused: nn.Module, name: str) -> None:
    """Give `fused` the parts' tensors `name` one after the other (a parameter or a buffer, as the
    parts hold it; None stays None), and make each part's the rows of it that it holds (a view)."""
    tensors = [getattr(part, name) for part in parts]
    if tensors[0] is None:
        setattr(fused, name, None)
        return
    whole = torch.cat([tensor.detach() for tensor in tensors])
    parameter = name in parts[0]._parameters
    _set(fused, name, whole, parameter, requires_grad=False)
    if whole.numel():  # bf16 keeps no scales
        for part, tensor, view in zip(parts, tensors, whole.split([len(t) for t in tensors]), strict=True):
            _set(part, name, view, parameter, tensor.requires_grad)


def _set(module: nn.Module, name: str, tensor: torch.Tensor, parameter: bool, requires_grad: bool) -> None:
    if parameter:
        setattr(module, name, nn.Parameter(tensor, requires_grad=requires_grad))
    else:
        module.register_buffer(name, tensor)
