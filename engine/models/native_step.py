"""A whole batched decode step in C (csrc/decode_step.c) for Llama-family models on CPU.

A step of SmolLM2-135M in torch is about 1,800 small operator calls; on 2 cores their
dispatch and the Python around them cost more than reading the weights. `NativeStep` hands the
step to one C call: the layers (norms, q/k/v, rotary, the key/value write, attention, the MLP),
the final norm and the head, over the model's own weights (float32 or bfloat16 modules, or
`--quantize` bf16/int8/int4; the weights are not copied) and each row's own key/value cache. It computes
each row alone, so a row's logits do not depend on the rows beside it.

Activations, norms, attention and the key/value cache are float32 whatever the weights are
(`CACHE_DTYPE`). A bfloat16 model is stepped as its weights widened to float32: its norm weights
and biases are copied to float32 once, its projections and head are read in bfloat16 as
`--quantize bf16`'s are. So on a CPU with fast bfloat16 a bfloat16 model prefills with bfloat16
matmuls (torch) and decodes at the speed of a step that reads half the bytes; its decode steps
compute in float32 what the bfloat16 modules compute with rounding between operations (close,
not bit-equal; tests/engine/test_native_step.py).

`NativeStep.build` returns None where the C step would not compute what the model's modules do
(another activation or norm, norms with different epsilons, per-head q/k norms, a layer type or shape the kernels do
not take, a model off the CPU or not in float32 or bfloat16) or the kernels cannot be built; the torch step is
used there. (A Neurocache adapter's LoRA layers reach it as their base layers: engine/models/llama_step.py.)
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Protocol, cast

import torch
from torch import nn

from engine.models import cpu_kernels
from engine.models.llama_parts import Layer, rms_norm_parts
from engine.models.quantize import WeightOnlyLinear

KINDS = {"float32": 0, "bf16": 1, "int8": 2, "int4": 3}  # csrc/weight_only.h
LINEAR_KINDS = {torch.float32: KINDS["float32"], torch.bfloat16: KINDS["bf16"]}  # a plain nn.Linear's weight
CACHE_DTYPE = torch.float32  # a row's keys and values, whatever the weights
_HOOK = ctypes.CFUNCTYPE(None, ctypes.c_long, ctypes.c_void_p)  # decode_step's before_attention


class StepRow(Protocol):
    """What the step needs of a row (engine/models/llama_step.py's `Row`)."""

    @property
    def keys(self) -> torch.Tensor | None: ...  # [layers, kv_heads, capacity, head_dim]

    @property
    def values(self) -> torch.Tensor | None: ...

    @property
    def length(self) -> int: ...


class CWeight(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("out", ctypes.c_long),
        ("in_", ctypes.c_long),
        ("kind", ctypes.c_long),
    ]


class CLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", CWeight),
        ("o", CWeight),
        ("gate_up", CWeight),
        ("down", CWeight),
    ]


class CShape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_long) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate")] + [
        ("eps", ctypes.c_float),
        ("scaling", ctypes.c_float),
    ]


class CRow(ctypes.Structure):
    _fields_ = [
        ("keys", ctypes.c_void_p),
        ("values", ctypes.c_void_p),
        ("capacity", ctypes.c_long),
        ("length", ctypes.c_long),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
    ]


def _weight(linear: nn.Module | None, kept: list[torch.Tensor]) -> CWeight | None:
    """A linear layer as the C step reads it, or None if it cannot (an adapter's layer, a layout
    or size the kernels do not take). A bias not in float32 is read from a float32 copy, appended
    to `kept` (which the step holds)."""
    if type(linear) is WeightOnlyLinear:
        stored, scale, kind = linear.weight_low, linear.scales if linear.mode != "bf16" else None, KINDS[linear.mode]
    elif type(linear) is nn.Linear and linear.weight.dtype in LINEAR_KINDS:
        stored, scale, kind = linear.weight, None, LINEAR_KINDS[linear.weight.dtype]
    else:
        return None
    bias = getattr(linear, "bias", None)
    features = linear.in_features
    if not cpu_kernels.usable(stored, features):
        return None
    if bias is not None:
        bias = bias.detach().to(torch.float32).contiguous()
        kept.append(bias)
    pointer = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    return CWeight(stored.data_ptr(), pointer(scale), pointer(bias), stored.shape[0], features, kind)


def _shapes_fit(shape: CShape, layers: list[CLayer], head: CWeight) -> bool:
    """Every weight [out, in] as the C step indexes it."""
    hidden, attention = shape.hidden, shape.heads * shape.head_dim
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    wanted = [(head, head.out, hidden)]
    for layer in layers:
        wanted += [
            (layer.qkv, qkv, hidden),
            (layer.o, hidden, attention),
            (layer.gate_up, 2 * shape.intermediate, hidden),
            (layer.down, hidden, shape.intermediate),
        ]
    return all((weight.out, weight.in_) == (out, in_) for weight, out, in_ in wanted)


class NativeStep:
    """The C decode step over one model (see the module's docstring)."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        shape: CShape,
        layers: ctypes.Array[CLayer],
        final_norm: torch.Tensor,
        head: CWeight,
        kept: list[torch.Tensor],
    ) -> None:
        """`kept`: every tensor the C structures point to, held here for as long as they do (some
        are float32 copies the model does not hold: a bfloat16 model's norms and biases)."""
        self.lib, self.shape, self.layers, self.final_norm, self.head, self.kept = lib, shape, layers, final_norm, head, kept
        lib.decode_step_scratch.restype = ctypes.c_long
        lib.decode_step_scratch.argtypes = [ctypes.POINTER(CShape), ctypes.c_long, ctypes.c_long]
        lib.decode_step.restype = None

    @classmethod
    def build(
        cls,
        model: nn.Module,
        layers: Sequence[Layer],
        qkv: Sequence[nn.Module | None],
        o: Sequence[nn.Module | None],
        gate_up: Sequence[nn.Module | None],
        down: Sequence[nn.Module | None],
    ) -> NativeStep | None:
        """The C step for this model's layers and the projections a step calls in them (q/k/v and
        gate/up fused, engine/models/fused.py), or None where it cannot run."""
        config = getattr(model, "config", None)
        if config is None or getattr(config, "hidden_act", None) != "silu" or getattr(model, "dtype", None) not in LINEAR_KINDS:
            return None
        lib = cpu_kernels.library()
        if lib is None:
            return None
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        built, eps_seen, scalings, norm_weights = [], set(), set(), []
        kept: list[torch.Tensor] = []  # the biases in float32 (copies where the model holds them in bfloat16)
        for layer, *projections in zip(layers, qkv, o, gate_up, down, strict=True):
            if hasattr(layer.self_attn, "q_norm") or hasattr(layer.self_attn, "k_norm"):  # Qwen3's per-head norms
                return None
            norms = rms_norm_parts(layer.input_layernorm, widen=True), rms_norm_parts(layer.post_attention_layernorm, widen=True)
            weights = [_weight(m, kept) for m in projections]
            if None in norms or None in weights:
                return None
            (input_norm, eps_in), (post_norm, eps_post) = cast(tuple[tuple[torch.Tensor, float], ...], norms)
            eps_seen |= {eps_in, eps_post}
            norm_weights += [input_norm, post_norm]
            scalings.add(float(layer.self_attn.scaling))
            built.append(CLayer(input_norm.data_ptr(), post_norm.data_ptr(), *cast(list[CWeight], weights)))
        final = rms_norm_parts(cast(nn.Module, model.model.norm), widen=True)
        head = _weight(cast(nn.Module, getattr(model, "lm_head", None)), kept)
        if final is None or head is None or len(eps_seen | {final[1]}) != 1 or len(scalings) != 1:
            return None
        if head_dim % 16 or heads % kv_heads or not built:
            return None
        intermediate = built[0].gate_up.out // 2
        shape = CShape(len(built), config.hidden_size, heads, kv_heads, head_dim, intermediate, final[1], scalings.pop())
        norm_weights = [final[0], *norm_weights]
        if not all(n.shape == (shape.hidden,) and n.is_contiguous() for n in norm_weights):
            return None
        if not _shapes_fit(shape, built, head):
            return None
        return cls(lib, shape, (CLayer * len(built))(*built), final[0], head, [*norm_weights, *kept])

    def __call__(
        self,
        hidden: torch.Tensor,
        rows: Sequence[StepRow],
        cos: torch.Tensor,
        sin: torch.Tensor,
        before_attention: Callable[[int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """hidden [B, d] (the tokens' embeddings, B >= len(rows): the extra rows are skipped), cos
        and sin [B, head_dim]; writes each row's key and value at its length; the logits [len(rows), V].
        `before_attention(layer, qkv)`, if given, is called in each layer with the rows' q, k and v
        before rotary ([rows, (heads + 2 kv_heads) head_dim], valid during the call) and may rewrite
        the rows' caches below their lengths before the layer attends. If it raises, the later
        layers' hooks are skipped (the C step still runs to its end, writing each row's key and
        value at its length), and the exception is raised here in place of the logits."""
        count, shape = len(rows), self.shape
        hidden = hidden[:count].to(torch.float32).contiguous().clone()
        cos, sin = cos[:count].to(torch.float32).contiguous(), sin[:count].to(torch.float32).contiguous()
        assert hidden.shape == (count, shape.hidden) and cos.shape == sin.shape == (count, shape.head_dim)
        step = shape.head_dim * cos.element_size()
        c_rows = (CRow * count)()
        caches = []  # held until the call returns: the C step writes into them
        for i, row in enumerate(rows):
            keys, values = row.keys, row.values
            assert keys is not None and values is not None
            capacity = keys.shape[2]
            for cache in (keys, values):
                layout = (shape.layers, shape.kv_heads, capacity, shape.head_dim)
                assert cache.dtype == CACHE_DTYPE and cache.is_contiguous() and cache.shape == layout
            if not row.length < capacity:  # the C step writes at `length` unchecked
                raise IndexError(f"row at {row.length} tokens has no room left ({capacity} reserved)")
            caches.append((keys, values))
            c_rows[i] = CRow(
                keys.data_ptr(), values.data_ptr(), capacity, row.length, cos.data_ptr() + i * step, sin.data_ptr() + i * step
            )
        longest = max(row.length for row in rows)
        scratch = torch.empty(self.lib.decode_step_scratch(ctypes.byref(self.shape), count, longest), dtype=torch.float32)
        logits = torch.empty(count, self.head.out, dtype=torch.float32)
        errors: list[BaseException] = []
        hook = None if before_attention is None else _HOOK(self._hook(before_attention, count, errors))
        self.lib.decode_step(
            ctypes.byref(self.shape),
            self.layers,
            ctypes.c_void_p(self.final_norm.data_ptr()),
            ctypes.byref(self.head),
            ctypes.c_void_p(hidden.data_ptr()),
            ctypes.c_long(count),
            c_rows,
            ctypes.c_void_p(scratch.data_ptr()),
            ctypes.c_void_p(logits.data_ptr()),
            hook,
        )
        del caches
        if errors:
            raise errors[0]
        return logits

    def _hook(
        self, before_attention: Callable[[int, torch.Tensor], None], count: int, errors: list[BaseException]
    ) -> Callable[[int, int], None]:
        shape = self.shape
        width = (shape.heads + 2 * shape.kv_heads) * shape.head_dim

        def call(layer: int, address: int) -> None:
            if errors:  # a layer before failed: the step's result is dropped
                return
            try:
                qkv = torch.frombuffer((ctypes.c_float * (count * width)).from_address(address), dtype=torch.float32)
                before_attention(layer, qkv.view(count, width))
            except BaseException as exc:  # ctypes would print and drop it
                errors.append(exc)

        return call
