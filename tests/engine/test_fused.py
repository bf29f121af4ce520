"""Fused projections (engine/models/fused.py): one matmul gives each part's output, the parts keep
computing as before from views of the fused weight (no memory added), and what cannot be fused
(an adapter's layer, mixed kinds or biases) is left alone."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import nn

from engine.models.fused import fuse_linears
from engine.models.quantize import WeightOnlyLinear


def features(mode: str) -> int:
    return 64 if mode == "int4" else 24  # int4 takes inputs in groups of 32


def parts(bias: bool, mode: str) -> list[nn.Module]:
    torch.manual_seed(0)
    linears: list[nn.Module] = [nn.Linear(features(mode), n, bias=bias) for n in (16, 8, 8)]
    return linears if mode == "none" else [WeightOnlyLinear(layer, mode) for layer in linears]  # type: ignore[arg-type]


def storage(tensor: object) -> int:
    assert isinstance(tensor, torch.Tensor)
    return tensor.untyped_storage().data_ptr()


def fused_outputs(layers: Sequence[nn.Module], x: torch.Tensor, tolerance: float) -> nn.Module:
    """Fuse `layers` and check, for input `x`, that the fused layer's output is each part's (within
    `tolerance`) and that each part gives afterwards exactly what it gave before; the fused layer."""
    with torch.no_grad():
        before = [layer(x) for layer in layers]
        fused = fuse_linears(layers)
        assert fused is not None
        together = fused(x)
        after = [layer(x) for layer in layers]
    assert together.shape == (*x.shape[:-1], 32)
    for piece, alone, again in zip(together.split([16, 8, 8], -1), before, after, strict=True):
        torch.testing.assert_close(piece, alone, rtol=tolerance, atol=tolerance)
        assert torch.equal(again, alone)
    return fused


@pytest.mark.parametrize("mode", ["none", "bf16", "int8", "int4"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3])
def test_the_fused_layer_gives_each_parts_output_and_the_parts_are_unchanged(mode, bias, rows):
    fused_outputs(parts(bias, mode), torch.randn(rows, 1, features(mode)), 1e-5 if mode == "int4" else 1e-6)


@pytest.mark.parametrize("mode", ["none", "bf16", "int8", "int4"])
def test_the_parts_weights_become_views_of_the_fused_weight(mode):
    layers = parts(True, mode)
    fused = fuse_linears(layers)
    assert fused is not None
    name = "weight" if mode == "none" else "weight_low"
    whole = getattr(fused, name)
    assert {storage(getattr(layer, name)) for layer in layers} == {storage(whole)}
    assert {storage(layer.bias) for layer in layers} == {storage(fused.bias)}
    if mode in ("int8", "int4"):
        assert {storage(layer.scales) for layer in layers} == {storage(fused.scales)}


def test_int8_over_bfloat16_parts_share_their_own_weights_too():
    """Fused int8 parts of a bf16 model: passes over many rows give each part's output from one
    matmul over the parts' bf16 weights, which become views of the fused one."""
    torch.manual_seed(0)
    layers = [WeightOnlyLinear(nn.Linear(32, n, bias=True).to(torch.bfloat16), "int8") for n in (16, 8, 8)]
    fused = fused_outputs(layers, torch.randn(40, 32).to(torch.bfloat16), 0.0)
    assert {storage(layer.weight_full) for layer in layers} == {storage(fused.weight_full)}


class Adapted(nn.Linear):
    """Another layer type, as an adapter's (Neurocache's LoRA) is: its forward is its own."""


def test_what_cannot_be_fused_is_left_alone():
    torch.manual_seed(0)
    plain = nn.Linear(24, 8)
    adapted = Adapted(24, 8)
    assert fuse_linears([plain, adapted]) is None
    assert fuse_linears([plain, nn.Linear(24, 8, bias=False)]) is None  # one with a bias, one without
    assert fuse_linears([plain, nn.Linear(12, 8)]) is None  # other inputs
    assert fuse_linears([plain, WeightOnlyLinear(nn.Linear(24, 8), "bf16")]) is None
    assert fuse_linears([WeightOnlyLinear(nn.Linear(24, 8), "bf16"), WeightOnlyLinear(nn.Linear(24, 8), "int8")]) is None
    assert fuse_linears([plain]) is None
    assert fuse_linears([plain, None]) is None
