"""One decode step of a Llama-family model (Llama, Qwen2, Mistral: pre-norm layers with rotary
attention) over many answers' rows, on the model's own weights.

The projections and MLPs of a step run on all rows at once (the weights are read once a step, not
once a request; q, k and v as one matmul, gate and up as another: engine/models/fused.py);
attention runs row by row over that row's own keys (no row sees another's; in the torch step a step
of 2 or 3 rows is padded to 4, see `INVARIANT_ROWS`, unless its weight-only projections compute each
row alone). On CPU the step is one C call where it can (engine/models/native_step.py; every row
computed alone, so never padded), else torch operators. The scheduler that decides which rows step
together is engine/runtime/scheduler.py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, DynamicLayer, PreTrainedModel
from transformers.models.llama.modeling_llama import rotate_half

from engine.interface import GenerationEvent, GenerationParams
from engine.models.fused import fuse_linears
from engine.models.llama_parts import Attention, Backbone, Layer, rms_norm_parts
from engine.models.native_step import CACHE_DTYPE, NativeStep
from engine.models.quantize import DECODE_ROWS, WeightOnlyLinear

if TYPE_CHECKING:
    from engine.runtime.generation import AnswerState
    from engine.runtime.kv_blocks import Held
    from engine.runtime.prefix_cache import Owner

BATCHED_FAMILIES = ("llama", "qwen2", "mistral")
# float32 matmuls on x86 (MKL) sum in one order for 1 row, another for 2-3, a third from 4 rows on
# (measured up to 32, bench/bench_batch_step.py). A step of 2 or 3 answers is padded to 4 rows: the
# same order as every larger batch, and no slower (a 4-row step measured faster than a 2-row one).
# A batch-invariant step pads a lone answer to 4 rows too, so a row's logits never depend on its
# company, at the cost of a 4-row step for a lone answer.
INVARIANT_ROWS = 4
log = logging.getLogger(__name__)


@dataclass(eq=False)
class Row:
    """One answer in the batch: its state, its key/value rows and where its events go."""

    prompt_ids: list[int]
    params: GenerationParams
    state: AnswerState | None = None  # made when the row is admitted: its clock starts there
    events: asyncio.Queue[GenerationEvent | BaseException] = field(default_factory=asyncio.Queue)
    keys: torch.Tensor | None = None  # [layers, kv_heads, capacity, head_dim]
    values: torch.Tensor | None = None
    length: int = 0  # positions filled
    cancelled: bool = False
    prompt_cache: DynamicCache | None = None  # the prompt's keys and values while it is fed in parts
    fed: int = 0  # prompt tokens fed so far
    room: int = 0  # positions its keys and values get when its prompt is in (0: prompt + max_tokens)
    resumed: list[int] = field(default_factory=list)  # answer tokens to feed again after the prompt (a preempted row)
    kv: Held | None = None  # the server's memory its blocks hold (engine/runtime/kv_blocks.py)
    blocks: int = 0
    waiting_since: float | None = None  # when it first found the server's memory short
    background: bool = False  # work no client waits on (a summary): queued behind the answers
    owner: Owner | None = None  # whose earlier prompts its own may start from (a session: engine/runtime/prefix_cache.py)
    keep_prompt: bool = False  # hand its prompt's own keys and values to `kept` once fed, not free them
    kept: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer [1, kv_heads, len(ids()), head_dim]

    def ids(self) -> list[int]:
        """What its prefill feeds: the prompt, and the answer so far when it resumes."""
        return self.prompt_ids + self.resumed if self.resumed else self.prompt_ids


def _rows_alone(projections: list[nn.Module]) -> bool:
    """Whether the step's `projections` give each row the same bits in any company of up to
    DECODE_ROWS rows: all weight-only, and each kernel, tried here on this CPU for every count of
    rows, computes a row as it does alone (longdoc's kernels do by design, torch's bf16 and int8 ones
    on x86 with AVX2 do as measured)."""
    if not all(type(m) is WeightOnlyLinear for m in projections):
        return False  # float32 (MKL sums in an order that depends on the rows), or an adapter's layer
    layers = cast(list[WeightOnlyLinear], projections)
    tried = {(m.mode, m.out_features, m.in_features): m for m in layers}
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for layer in tried.values():
            x = torch.randn(DECODE_ROWS, layer.in_features, generator=generator).to(layer.weight_low.device)
            alone = torch.cat([layer(x[i : i + 1]) for i in range(DECODE_ROWS)])
            if not all(torch.equal(layer(x[:n]), alone[:n]) for n in range(2, DECODE_ROWS + 1)):
                return False
    return True


def _rms_norm(norm: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A float32 Llama-family RMSNorm as one call of torch's (the same sums, fewer calls); any other
    norm as itself."""
    parts = rms_norm_parts(norm)
    if parts is None:
        return cast(Callable[[torch.Tensor], torch.Tensor], norm)
    weight, eps = parts
    return functools.partial(F.rms_norm, normalized_shape=(weight.shape[0],), weight=weight, eps=eps)


@runtime_checkable
class Wrapped(Protocol):
    """A layer a memory's adapter wraps (a low-rank adapter over a projection): outside the memory's binding it
    computes exactly the layer `outside_binding` returns. A batched step never runs inside a binding
    (a binding covers single forward passes on the compute thread), so it calls that layer. Only a
    method here: from Python 3.12 `isinstance` looks attributes up statically, and a torch
    submodule (kept in `_modules`) would not be found."""

    def outside_binding(self) -> nn.Module:
        """The layer this one computes outside a binding."""
        ...


def _plain(module: nn.Module | None) -> nn.Module | None:
    """A projection as a batched step computes it: a wrapped layer is its base layer."""
    return module.outside_binding() if isinstance(module, Wrapped) else module


def _base(layer: torch.nn.Module) -> Layer:
    """A decoder layer under a memory's wrapper (which adds nothing while no memory is bound)."""
    return cast(Layer, getattr(layer, "base", layer))


_StepParts = tuple[list[Layer], list[nn.Module | None], list[nn.Module], list[nn.Module | None], list[nn.Module | None]]


def _step_parts(model: PreTrainedModel) -> _StepParts:
    """The layers and the projections a decode step calls in them: q, k and v as one matmul, and
    gate and up as another, where the layer's projections allow it (else None); o; down."""
    layers = [_base(layer) for layer in cast(Backbone, model.model).layers]
    attentions, mlps = [layer.self_attn for layer in layers], [layer.mlp for layer in layers]
    qkv = [fuse_linears([_plain(a.q_proj), _plain(a.k_proj), _plain(a.v_proj)]) for a in attentions]
    gate_up = [fuse_linears([_plain(getattr(m, n, None)) for n in ("gate_proj", "up_proj")]) for m in mlps]
    o = [cast(nn.Module, _plain(a.o_proj)) for a in attentions]
    down = [_plain(getattr(m, "down_proj", None)) for m in mlps]
    return layers, qkv, o, gate_up, down


def native_step(model: PreTrainedModel) -> NativeStep | None:
    """The C decode step (engine/models/native_step.py) of a model the batched step supports, on
    CPU; None elsewhere. For single answers stepped outside the batch (a memory that steps its own answers)."""
    if model.device.type != "cpu" or not BatchDecoder.supports(model):
        return None
    return NativeStep.build(model, *_step_parts(model))


class BatchDecoder:
    """Prefill one row, then step many rows a token each, on a Llama-family model."""

    def __init__(self, model: PreTrainedModel, invariant: bool = False) -> None:
        self.model = model
        self.invariant = invariant
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.layers, self.qkv, self.o, self.gate_up, self.down = _step_parts(model)
        # the whole step as one C call where it computes what the modules do (engine/models/native_step.py)
        self.native = None
        if model.device.type == "cpu":
            self.native = NativeStep.build(model, self.layers, self.qkv, self.o, self.gate_up, self.down)
        # a step whose projections compute each row alone (the C step; weight-only kernels) needs no
        # padding for a row's logits to be the same in any company
        self.rows_alone = self.native is not None or _rows_alone(self._projections())
        self.cache_dtype = CACHE_DTYPE if self.native is not None else model.dtype  # a row's keys and values
        # int8 or int4 over a bf16 model runs passes over more than DECODE_ROWS rows through the model's own
        # weights: a prompt is fed in parts of more than DECODE_ROWS tokens (a short last part joins
        # the one before), so a prompt longer than that runs through them. A prompt of DECODE_ROWS
        # tokens or fewer, and the head's one row that gives the first token, read the int8 copy
        # as decode steps do.
        self.whole_tail = any(type(m) is WeightOnlyLinear and m.weight_full is not None for m in model.modules())
        log.info("%s: decode steps %s", type(model).__name__, "in C" if self.native is not None else "in torch")
        self.norms = [(_rms_norm(layer.input_layernorm), _rms_norm(layer.post_attention_layernorm)) for layer in self.layers]
        self.final_norm = _rms_norm(cast(Backbone, model.model).norm)

    def _projections(self) -> list[nn.Module]:
        """The linear layers a decode step calls: fused or not, per layer, and the output head."""
        called: list[nn.Module] = []
        for layer, qkv, gate_up, o, down in zip(self.layers, self.qkv, self.gate_up, self.o, self.down, strict=True):
            attention, mlp = layer.self_attn, layer.mlp
            called += [qkv] if qkv is not None else [attention.q_proj, attention.k_proj, attention.v_proj]
            called += [gate_up] if gate_up is not None else [getattr(mlp, "gate_proj", mlp), getattr(mlp, "up_proj", mlp)]
            called += [o, down if down is not None else mlp]
        return [*called, cast(nn.Module, self.model.lm_head)]

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        config = getattr(model, "config", None)
        inner = getattr(model, "model", None)
        family = getattr(config, "model_type", None)
        sliding = (
            "sliding_attention" in (getattr(config, "layer_types", None) or ())
            or (family == "mistral" and getattr(config, "sliding_window", None) is not None)
            or getattr(config, "use_sliding_window", False)
        )
        rope = (getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}).get("rope_type")
        return (
            family in BATCHED_FAMILIES
            and not sliding  # every row attends to all its keys
            and rope not in ("dynamic", "longrope")  # these pick frequencies from the whole batch's positions
            and hasattr(inner, "rotary_emb")
            and hasattr(inner, "layers")
        )

    def prefill(self, row: Row) -> torch.Tensor:
        """Run the row's prompt, keep its keys and values; the last position's logits [V]."""
        logits = self.prefill_part(row, None)
        assert logits is not None  # the whole prompt was fed
        return logits

    @torch.inference_mode()
    def prefill_part(self, row: Row, tokens: int | None) -> torch.Tensor | None:
        """Feed the row's next `tokens` prompt tokens (None: all that are left). Once the whole
        prompt is in, keep its keys and values in the row's own rows (prompt + max_tokens) and
        return the last position's logits [V]; None while some of the prompt is left."""
        model, ids = self.model, row.ids()
        if row.prompt_cache is None:
            row.prompt_cache, row.fed = DynamicCache(), 0
        end = len(ids) if tokens is None else min(len(ids), row.fed + tokens)
        if self.whole_tail:  # no part of DECODE_ROWS tokens or fewer, unless the prompt is that short
            end = min(len(ids), max(end, row.fed + DECODE_ROWS + 1))
            end = len(ids) if len(ids) - end <= DECODE_ROWS else end
        part = torch.tensor([ids[row.fed : end]], device=model.device)
        out = model(input_ids=part, past_key_values=row.prompt_cache, use_cache=True, logits_to_keep=1)
        row.fed = end
        if end < len(ids):
            return None
        cache, row.prompt_cache = row.prompt_cache, None
        capacity = row.room or len(row.prompt_ids) + row.params.max_tokens
        if capacity <= len(ids):
            raise ValueError(f"a row of {len(ids)} tokens was given room for {capacity}")
        row.keys, row.values = self._buffer(capacity), self._buffer(capacity)
        row.kept = [] if row.keep_prompt else None
        for index, layer in enumerate(
            cast(list[DynamicLayer], cache.layers)
        ):  # each layer freed once copied (unless kept): the peak stays near the reservation
            assert layer.keys is not None and layer.values is not None  # filled by the prompt's pass
            row.keys[index, :, : len(ids)] = layer.keys[0]
            row.values[index, :, : len(ids)] = layer.values[0]
            if row.kept is not None:
                row.kept.append((layer.keys, layer.values))
            layer.keys = layer.values = None
        row.length = len(ids)
        return cast(torch.Tensor, out.logits[0, -1])

    def _buffer(self, capacity: int) -> torch.Tensor:
        """Keys or values of one row: [layers, kv_heads, capacity, head_dim]."""
        shape = (len(self.layers), self.kv_heads, capacity, self.head_dim)
        return torch.empty(shape, device=self.model.device, dtype=self.cache_dtype)

    def grow(self, row: Row, capacity: int) -> None:
        """Move the row's keys and values into buffers of `capacity` positions (the same bits)."""
        assert row.keys is not None and row.values is not None and capacity > row.length
        for name in ("keys", "values"):
            old, new = getattr(row, name), self._buffer(capacity)
            new[:, :, : row.length] = old[:, :, : row.length]
            setattr(row, name, new)

    def step_rows(self, answers: int) -> int:
        """Rows a step computes for `answers` answers. The C step computes each row alone: never
        padded. In the torch step 2 or 3 are padded to 4, and so is a lone answer when
        batch-invariant (a lone answer otherwise steps alone: a 1-row step is the fastest); up to
        DECODE_ROWS answers, a torch step whose projections compute each row alone (`--quantize`)
        is not padded."""
        assert answers > 0
        if self.native is not None:
            return answers
        if self.rows_alone and answers <= DECODE_ROWS:
            return answers
        if answers >= INVARIANT_ROWS or (answers == 1 and not self.invariant):
            return answers
        return INVARIANT_ROWS

    @torch.inference_mode()
    def step(self, rows: list[Row]) -> torch.Tensor:
        """Feed each row its next token at its own position; the logits [rows, V]."""
        model, device = self.model, self.model.device
        assert all(row.state is not None for row in rows)
        states = [cast("AnswerState", row.state) for row in rows]
        padding = [states[0].next_token] * (self.step_rows(len(rows)) - len(rows))  # rows computed, then dropped
        tokens = torch.tensor([[state.next_token] for state in states] + [[t] for t in padding], device=device)
        positions = torch.tensor([[row.length] for row in rows] + [[rows[0].length]] * len(padding), device=device)
        inner = cast(Backbone, model.model)
        hidden = inner.embed_tokens(tokens)  # [B, 1, d]
        # [B, 1, head_dim]: broadcast over heads below; in float32 for the C step, whatever the model
        cos, sin = inner.rotary_emb(hidden if self.native is None else hidden.to(CACHE_DTYPE), positions)
        if self.native is not None:
            logits = self.native(hidden[:, 0], rows, cos[:, 0], sin[:, 0])
            for row in rows:
                row.length += 1
            return logits
        for index, (layer, (input_norm, post_norm)) in enumerate(zip(self.layers, self.norms, strict=True)):
            hidden = hidden + self._attention(index, layer.self_attn, input_norm(hidden), cos, sin, rows)
            hidden = hidden + self._mlp(index, layer.mlp, post_norm(hidden))
        logits = cast(nn.Linear, model.lm_head)(self.final_norm(hidden))[: len(rows), 0]
        for row in rows:  # only a step that succeeded moves the rows on
            row.length += 1
        return logits

    def _mlp(self, index: int, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        fused = self.gate_up[index]
        if fused is None:
            return cast(torch.Tensor, mlp(x))
        gate, up = fused(x).chunk(2, dim=-1)
        down, act = cast(nn.Module, self.down[index]), cast(Callable[[torch.Tensor], torch.Tensor], mlp.act_fn)
        return cast(torch.Tensor, down(act(gate) * up))

    def _qkv(
        self, index: int, attention: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """Each row's queries [B, heads, d] and key and value [B, kv_heads, d], rotary applied."""
        batch, fused, heads, kv_heads, head_dim = x.shape[0], self.qkv[index], self.heads, self.kv_heads, self.head_dim
        if fused is None:
            q, k, v = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
            qk = torch.cat([q.view(batch, heads, head_dim), k.view(batch, kv_heads, head_dim)], 1)
        else:  # q and k side by side in the fused output: rotary on both at once
            out = fused(x).view(batch, heads + 2 * kv_heads, head_dim)
            qk, v = out[:, : heads + kv_heads], out[:, heads + kv_heads :]
        qk = qk * cos + rotate_half(qk) * sin
        return qk[:, :heads], qk[:, heads:], v.reshape(batch, kv_heads, head_dim)

    def _attention(
        self, index: int, attention: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: list[Row]
    ) -> torch.Tensor:
        q, k, v = self._qkv(index, attention, x, cos, sin)
        # each query head's group of its key/value head: [kv_heads, group, d], scaled
        groups = (q * attention.scaling).view(q.shape[0], self.kv_heads, -1, self.head_dim)
        out = torch.zeros(q.shape[0], 1, self.heads * self.head_dim, dtype=q.dtype, device=q.device)  # padding rows: nothing
        for i, row in enumerate(rows):
            assert row.keys is not None and row.values is not None
            keys, values, end = row.keys[index], row.values[index], row.length + 1
            keys[:, row.length], values[:, row.length] = k[i], v[i]
            weights = torch.softmax(torch.matmul(groups[i], keys[:, :end].transpose(1, 2)), dim=-1)
            out[i, 0] = torch.matmul(weights, values[:, :end]).view(-1)
        return cast(torch.Tensor, self.o[index](out))
