"""Weight-only quantization for decoding on CPU (`longdoc serve --quantize bf16|int8|int4`).

A decode step reads every weight once for one row of activations, so on CPU its time is the time
to stream the weights from memory: fewer bytes a weight, faster steps. A decode step's matmul (up
to DECODE_ROWS rows) runs longdoc's own kernel (engine/models/cpu_kernels.py: float32 activations,
each weight widened to float32 as it is read; int4 by default rounds the activations to int8 and
multiplies bytes instead, and int8 does too with AVX-512 VNNI) where it could be built, else torch's weight-only kernel (activations
rounded to bfloat16); the result is in the model's dtype. Norms, the
key/value cache and attention stay in the model's dtype (a float32 model's: CPUs without native
bfloat16 run float32 attention several times faster than bfloat16; the C decode step computes them
in float32 for any model). The speed-up needs one OpenMP team on the cores (engine/runtime/worker.py).

- `bf16`: weights kept in bfloat16 (half the bytes).
- `int8`: weights kept in int8 with one float scale per output row (a quarter of the bytes).
- `int4`: the decoder projections in 4 bits, each group of 32 inputs of a row with its own
  scale and minimum (bfloat16): 5 bits a weight, 0.16 of float32's bytes; the output head in int8
  (as llama.cpp's Q4_K_M keeps it in more bits), and so is a projection whose inputs are not a
  multiple of 32. Its matmuls need longdoc's kernels; without them a decode step widens the weights.

A pass over many rows (a prompt's prefill) is compute-bound, not memory-bound. A float32 model's
layers widen the stored weights back to float32 for that pass (int4: longdoc's C conversion, into
a buffer the thread keeps) and run the float32 matmul. A
bfloat16 model (`int8` and `int4`: on a CPU with fast bfloat16 matmuls, where `dtype auto` loads
one) keeps its bfloat16 weights beside the low-bit ones and prefills with them (engine/models/llama_step.py feeds such a
model a prompt longer than DECODE_ROWS tokens in parts longer than that), so its prompts keep the
bfloat16 matmuls' speed: half as many bytes again as the bfloat16 weights (int4: a third), for decode steps that
read half of them. The decoder layers' projections and the output head are converted; the embedding
stays as it is (a lookup reads a row). What each mode costs in answers is measured on the QA
benchmark (docs/studies/quantize.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import QUANTIZE_MODES
from engine.models import cpu_kernels

DECODE_ROWS = 16  # passes of at most this many rows use the low-precision kernel
# torch's int8 decode kernel gets rows of a multiple of this many inputs only: on an AVX-512 CPU
# (torch 2.13) it gave garbage or NaN for 8, 24 and 40 inputs, and was right for 16, 32, 48, 64, 96, 576
INT8PACK_ALIGN = 16
QUANTIZED_DTYPES = {
    "bf16": (torch.float32,),
    "int8": (torch.float32, torch.bfloat16),
    "int4": (torch.float32, torch.bfloat16),
}  # the models each mode takes
GROUP = 32  # int4: inputs sharing a scale and a minimum
LINEAR_NAMES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"})


QUANTIZE_ROWS = 4096  # output rows quantized at a time


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [out, in] as int8 [out, in] and one float32 scale a row [out] (its largest
    magnitude over 127), QUANTIZE_ROWS rows at a time: the float32 temporaries stay a block's
    (a bf16 model's head widened whole is about 0.9 GB on the default model)."""
    quantized = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], QUANTIZE_ROWS):
        block = weight[start : start + QUANTIZE_ROWS].float()  # [rows, in]
        block_scales = block.abs().amax(dim=1).clamp(min=1e-12) / 127  # [rows]
        quantized[start : start + QUANTIZE_ROWS] = torch.round(block / block_scales[:, None]).clamp(-127, 127)
        scales[start : start + QUANTIZE_ROWS] = block_scales
    return quantized, scales


def int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [out, in] (in a multiple of GROUP) as codes 0-15, two to a byte [out, in / 2]
    (in each group's 16 bytes, byte j holds input j in its low half and input j + 16 in its high
    half), and each group's scale and minimum [out, in / GROUP, 2] in bfloat16 (the minimum and
    range / 15 of its weights), so that a weight is scale * code + minimum; QUANTIZE_ROWS rows at
    a time."""
    out, features = weight.shape
    packed = torch.empty(out, features // 2, dtype=torch.uint8, device=weight.device)
    groups = torch.empty(out, features // GROUP, 2, dtype=torch.bfloat16, device=weight.device)
    for start in range(0, out, QUANTIZE_ROWS):
        block = weight[start : start + QUANTIZE_ROWS].float().view(-1, features // GROUP, GROUP)
        low = block.amin(dim=-1)
        scale = ((block.amax(dim=-1) - low) / 15).clamp(min=1e-12)
        pair = torch.stack([scale, low], dim=-1).to(torch.bfloat16)  # rounded first: codes fit the stored pair
        scale, low = pair[..., 0].float(), pair[..., 1].float()
        codes = torch.round((block - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
        packed[start : start + QUANTIZE_ROWS] = (codes[..., :16] | (codes[..., 16:] << 4)).view(len(block), -1)
        groups[start : start + QUANTIZE_ROWS] = pair
    return packed, groups


def int4_weight(packed: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """The float32 weight [out, in] that `int4_groups`' codes and groups stand for."""
    out = packed.shape[0]
    halves = packed.view(out, -1, GROUP // 2)
    codes = torch.cat([halves & 15, halves >> 4], dim=-1).float()  # [out, groups, GROUP]
    pairs = groups.float()
    return (codes * pairs[..., :1] + pairs[..., 1:]).view(out, -1)


class WeightOnlyLinear(nn.Module):
    """An nn.Linear whose weight is stored in bfloat16, int8 (per output row scales) or int4
    (per group of 32 inputs scales and minimums)."""

    weight_low: torch.Tensor  # [out, in] bfloat16 or int8; [out, in / 2] uint8 (int4)
    scales: torch.Tensor  # [out] float32 (int8), [out, in / 32, 2] bfloat16 (int4), empty (bf16)
    scales_low: torch.Tensor  # the scales in bfloat16
    weight_full: torch.Tensor | None  # a bfloat16 model's own weight, for passes over many rows
    bias: nn.Parameter | None

    def __init__(self, linear: nn.Linear, mode: str) -> None:
        super().__init__()
        if mode not in QUANTIZE_MODES[1:]:
            raise ValueError(f"unknown quantize mode {mode!r}; choose one of {QUANTIZE_MODES[1:]}")
        self.mode, self.in_features, self.out_features = mode, linear.in_features, linear.out_features
        if mode == "int4" and linear.in_features % GROUP:
            raise ValueError(f"int4 needs in_features a multiple of {GROUP}, not {linear.in_features}")
        keeps_full = linear.weight.dtype == torch.bfloat16
        if keeps_full and mode == "bf16":
            raise ValueError("a bfloat16 model already decodes from bfloat16 weights: quantize it to int8 or int4, or none")
        self.register_buffer("weight_full", linear.weight.detach() if keeps_full else None)
        weight = linear.weight.detach()
        if mode == "bf16":
            self.register_buffer("weight_low", weight.to(torch.bfloat16).contiguous())
            self.register_buffer("scales", torch.ones(0))
        elif mode == "int4":
            weight_low, scales = int4_groups(weight)
            self.register_buffer("weight_low", weight_low)
            self.register_buffer("scales", scales)
        else:
            weight_low, scales = int8_rows(weight)
            self.register_buffer("weight_low", weight_low)
            self.register_buffer("scales", scales)
        low = self.scales.to(torch.bfloat16) if mode == "int8" else torch.ones(0)  # what torch's int8 kernel takes, made once
        self.register_buffer("scales_low", low)
        self.bias = linear.bias

    @classmethod
    def shell(cls, mode: str, in_features: int, out_features: int) -> WeightOnlyLinear:
        """A layer with its sizes and mode but no tensors yet (engine/models/fused.py fills them)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.mode, layer.in_features, layer.out_features = mode, in_features, out_features
        layer.register_buffer("weight_full", None)
        return layer

    def dequantized(self) -> torch.Tensor:
        """The stored weight as float32 [out, in]."""
        if self.mode == "int4":
            if cpu_kernels.usable(self.weight_low, self.in_features):  # the same bits, faster
                return cpu_kernels.int4_dequantize(self.weight_low, self.scales)
            return int4_weight(self.weight_low, self.scales)
        weight = self.weight_low.float()
        return weight * self.scales[:, None] if self.mode == "int8" else weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > DECODE_ROWS:  # the plain layer's matmul, its bias added as nn.Linear adds it
            if self.weight_full is not None:
                weight = self.weight_full
            elif self.mode == "int4" and not torch.is_grad_enabled() and cpu_kernels.usable(self.weight_low, self.in_features):
                # used at once, and kept by no graph (a backward pass would read it after the next layer wrote it)
                weight = cpu_kernels.int4_dequantize(self.weight_low, self.scales, reuse=True)
            else:
                weight = self.dequantized()
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(rows, weight.to(x.dtype), bias).view(*x.shape[:-1], self.out_features)
        if not torch.is_grad_enabled() and cpu_kernels.usable(self.weight_low, self.in_features):  # no gradient in C
            if self.mode == "int4":
                out = cpu_kernels.int4_matmul(rows, self.weight_low, self.scales).to(x.dtype)
            else:
                out = cpu_kernels.matmul(rows, self.weight_low, self.scales if self.mode == "int8" else None).to(x.dtype)
        elif self.mode == "int4":  # torch has no kernel for this layout: the widened weight
            out = F.linear(rows.float(), self.dequantized()).to(x.dtype)
        elif self.mode == "bf16":
            out = F.linear(rows.to(torch.bfloat16), self.weight_low).to(x.dtype)
        elif self.in_features % INT8PACK_ALIGN == 0:
            out = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16).contiguous(), self.weight_low, self.scales_low).to(
                x.dtype
            )
        else:  # the same product in float32, the weight widened for the call
            weight = self.weight_low.float() * self.scales_low.float()[:, None]
            out = F.linear(rows.to(torch.bfloat16).float(), weight).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"


def quantize_linears(model: nn.Module, mode: str) -> int:
    """Replace the decoder projections and the output head (plain nn.Linear children named as in
    Llama-family models) with `WeightOnlyLinear`; returns how many were replaced. Layers an
    adapter wraps (Neurocache's LoRA, its cache attention) are other module types and stay as
    they are."""
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"unknown quantize mode {mode!r}; choose one of {QUANTIZE_MODES}")
    if mode == "none":
        return 0
    replaced: list[tuple[nn.Module, str, nn.Linear]] = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if name in LINEAR_NAMES and type(child) is nn.Linear:
                replaced.append((parent, name, child))
    for _, _, child in replaced:
        if child.weight.dtype not in QUANTIZED_DTYPES[mode] or child.weight.device.type != "cpu":
            takes = " or ".join(str(dtype).removeprefix("torch.") for dtype in QUANTIZED_DTYPES[mode])
            raise ValueError(f"{mode} weight-only quantization is for {takes} models on CPU")
    for parent, name, child in replaced:
        setattr(parent, name, WeightOnlyLinear(child, _layer_mode(name, child, mode)))
    return len(replaced)


def stored_mode(model: nn.Module) -> str:
    """How the model's converted layers are stored, as `--quantize` names it: "int4" when any
    projection is 4-bit (its head is int8), else the one mode they share; "none" if none is."""
    modes = {m.mode for m in model.modules() if isinstance(m, WeightOnlyLinear)}
    if "int4" in modes:
        return "int4"
    return modes.pop() if len(modes) == 1 else "none"


def _layer_mode(name: str, linear: nn.Linear, mode: str) -> str:
    """int4 keeps the output head, and a layer whose inputs are not a multiple of GROUP, in int8."""
    if mode == "int4" and (name == "lm_head" or linear.in_features % GROUP):
        return "int8"
    return mode
