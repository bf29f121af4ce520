"""Continuous batching: the answers of one model are decoded together, one forward pass a step.

Requests join between steps and leave when they finish, are cancelled or fail. Each prompt is fed
on its own, `prefill_chunk` tokens a step between the others' steps, so a long prompt stalls the
others for one chunk at a time. Each keeps its own
sampling, stop strings and repetition guard (`AnswerState`), and its own key/value rows sized
prompt + max_tokens, as reserved before it was admitted. The projections and MLPs of a step run
on all rows at once (the weights are read once a step, not once a request; q, k and v as one
matmul, gate and up as another: engine/models/fused.py); attention runs row by row over that
row's own keys (no row sees another's; in the torch step a step of 2 or 3 rows is padded to 4, see
`INVARIANT_ROWS`, unless its weight-only projections compute each row alone).

`BatchDecoder` steps Llama-family models (Llama, Qwen2, Mistral: pre-norm layers with rotary
attention) on their own weights: on CPU as one C call a step where it can (engine/models/
native_step.py; every row computed alone, so never padded), else through torch operators; a model
it does not support is answered one request at a time, as before.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, DynamicLayer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.llama.modeling_llama import rotate_half

from engine.generation import AnswerState, StopTokens
from engine.interface import GenerationDone, GenerationEvent, GenerationParams
from engine.models.fused import fuse_linears
from engine.models.llama_parts import Attention, Backbone, Layer, rms_norm_parts
from engine.models.native_step import CACHE_DTYPE, NativeStep
from engine.models.neurocache import LoRALinear
from engine.models.quantize import DECODE_ROWS, WeightOnlyLinear
from engine.worker import SerialWorker

BATCHED_FAMILIES = ("llama", "qwen2", "mistral")
# float32 matmuls on x86 (MKL) sum in one order for 1 row, another for 2-3, a third from 4 rows on
# (measured up to 32, bench/bench_batch_step.py). A step of 2 or 3 answers is padded to 4 rows: the
# same order as every larger batch, and no slower (a 4-row step measured faster than a 2-row one).
# A batch-invariant step pads a lone answer to 4 rows too, so a row's logits never depend on its
# company, at the cost of a 4-row step for a lone answer.
INVARIANT_ROWS = 4
log = logging.getLogger(__name__)
_Events = list[tuple["Row", list[GenerationEvent | BaseException]]]  # what a tick hands each row


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


def _plain(module: nn.Module | None) -> nn.Module | None:
    """A projection as a batched step computes it: a Neurocache adapter's LoRA layer is its base
    layer, as it is outside a Neurocache binding, and a batched step never runs inside one (a
    binding covers single forward passes on the compute thread, engine/models/neurocache.py)."""
    return module.base if isinstance(module, LoRALinear) else module


def _base(layer: torch.nn.Module) -> Layer:
    """A decoder layer under a Neurocache wrapper (which adds nothing while no cache is attached)."""
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
    CPU; None elsewhere. For single answers stepped outside the batch (the kvcache memory's)."""
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
        model, ids = self.model, row.prompt_ids
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
        capacity = len(ids) + row.params.max_tokens
        shape = (len(self.layers), self.kv_heads, capacity, self.head_dim)
        row.keys = torch.empty(shape, device=model.device, dtype=self.cache_dtype)
        row.values = torch.empty(shape, device=model.device, dtype=self.cache_dtype)
        for index, layer in enumerate(
            cast(list[DynamicLayer], cache.layers)
        ):  # each layer freed once copied: the peak stays near the reservation
            assert layer.keys is not None and layer.values is not None  # filled by the prompt's pass
            row.keys[index, :, : len(ids)] = layer.keys[0]
            row.values[index, :, : len(ids)] = layer.values[0]
            layer.keys = layer.values = None
        row.length = len(ids)
        return cast(torch.Tensor, out.logits[0, -1])

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
        states = [cast(AnswerState, row.state) for row in rows]
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


class Batcher:
    """Schedules the answers of one model on its worker thread, stepping them together."""

    def __init__(
        self,
        decoder: BatchDecoder,
        worker: SerialWorker,
        tokenizer: PreTrainedTokenizerBase,
        stop_tokens: StopTokens,
        max_rows: int,
        prefill_chunk: int | None = None,
    ) -> None:
        self._decoder = decoder
        self._worker = worker
        self._tokenizer = tokenizer
        self._stop_tokens = stop_tokens
        self.max_rows = max_rows
        self.prefill_chunk = prefill_chunk  # prompt tokens fed a step (None: a whole prompt)
        self._waiting: collections.deque[Row] = collections.deque()
        self._rows: list[Row] = []  # touched on the worker thread only
        self._prefilling: Row | None = None  # the admitted row whose prompt is being fed, a chunk a step
        self._step_first = False  # the last tick ended a prompt: this one steps the rows before feeding any
        self._loop_task: asyncio.Task[None] | None = None

    @property
    def rows(self) -> int:
        """Answers in the batch now (admitted, not yet finished)."""
        return len(self._rows)

    @torch.inference_mode()
    def warm_up(self, prompt_ids: list[int], params: GenerationParams) -> None:
        """One answer's prefill and decode step, thrown away, called directly (not through the
        worker) on the compute thread before the first tick (engine/registry.py's `warm_up` says why)."""
        row = Row(list(prompt_ids), params)
        row.state = AnswerState(self._tokenizer, row.prompt_ids, row.params, self._stop_tokens)
        row.state.take(self._decoder.prefill(row))
        row.state.take(self._decoder.step([row])[0])

    async def generate(self, prompt_ids: list[int], params: GenerationParams) -> AsyncGenerator[GenerationEvent, None]:
        """Text deltas, then done; leaving early cancels the row before its next step."""
        row = Row(list(prompt_ids), params)
        self._waiting.append(row)
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        try:
            while True:
                event = await row.events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if isinstance(event, GenerationDone):
                    return
        finally:
            row.cancelled = True

    async def _run(self) -> None:
        """Tick while there is work. The next tick is queued before this one's events are handed
        out, so the compute thread steps again while the event loop streams them."""
        try:
            ticking = self._worker.start(self._tick)
            while True:
                done = await ticking
                busy = bool(self._rows or self._waiting or self._prefilling is not None)
                try:
                    if busy:
                        ticking = self._worker.start(self._tick)
                finally:  # a stopped worker fails the rows left below; those this tick ended get their events
                    for row, events in done:
                        for event in events:
                            row.events.put_nowait(event)
                if not busy:
                    return
        except BaseException as exc:  # shutdown, or a fault of the scheduler itself: no row waits forever
            failure = exc if isinstance(exc, Exception) else RuntimeError("the model worker stopped")
            prefilling = [] if self._prefilling is None else [self._prefilling]
            for row in [*list(self._rows), *prefilling, *list(self._waiting)]:
                row.cancelled = True
                row.keys = row.values = row.prompt_cache = None
                row.events.put_nowait(failure.with_traceback(None))
            self._rows, self._waiting, self._prefilling, self._step_first = [], collections.deque(), None, False
            if not isinstance(exc, Exception):
                raise
            log.exception("the batch scheduler failed; its answers ended with the error")

    @torch.inference_mode()
    def _tick(self) -> _Events:
        """On the worker thread: feed the admitted prompt its next chunk (admitting a waiting row
        when none is being fed), then step every row once. A tick whose chunk ends a prompt
        returns there, so that row's first token goes out before a decode step; the next tick
        steps every row, that one too, and feeds no prompt."""
        out: _Events = []
        self._keep_live()
        step_first, self._step_first = self._step_first and bool(self._rows), False
        while not step_first and self._prefilling is None and self._waiting and len(self._rows) < self.max_rows:
            row = self._waiting.popleft()
            if not row.cancelled:
                row.state = AnswerState(self._tokenizer, row.prompt_ids, row.params, self._stop_tokens)
                self._prefilling = row
        if self._prefilling is not None and not step_first:
            self._feed(self._prefilling, out)
            if self._prefilling is None and out:  # the prompt is in, and its first token (or error) is out
                self._step_first = True
                self._keep_live()
                return out
        self._keep_live()
        if self._rows:
            self._advance(self._rows, self._decoder.step, out)
        self._keep_live()
        return out

    def _feed(self, row: Row, out: _Events) -> None:
        """One chunk of the admitted row's prompt; with its last chunk it joins the batch with its
        first token. A cancelled or failed prefill ends that row alone."""
        if row.cancelled:
            self._prefilling, row.prompt_cache = None, None
            return
        try:
            logits = self._decoder.prefill_part(row, self.prefill_chunk)
        except Exception as exc:
            self._prefilling, row.prompt_cache, row.cancelled = None, None, True
            out.append((row, [exc.with_traceback(None)]))
            return
        if logits is None:
            return  # more of its prompt on the next tick
        self._prefilling = None
        self._advance([row], lambda rows: logits.unsqueeze(0), out)
        self._rows.append(row)

    def _keep_live(self) -> None:
        """Drop rows that finished, failed or were cancelled, and their keys and values."""
        for row in self._rows:
            if row.cancelled or row.state is None or row.state.finished:
                row.keys = row.values = None
        self._rows = [row for row in self._rows if row.keys is not None]

    def _advance(self, rows: list[Row], forward: Callable[[list[Row]], torch.Tensor], out: _Events) -> None:
        """Run `forward` on `rows` and hand each its logits. A failed step is retried row by row
        (a row's position only moves when its step succeeds), so an error ends only its own row."""
        try:
            logits = forward(rows).float().cpu()  # one copy for the batch, not one per row
        except Exception as exc:
            if len(rows) > 1:
                for row in rows:
                    self._advance([row], forward, out)
                return
            rows[0].cancelled = True
            out.append((rows[0], [exc.with_traceback(None)]))
            return
        for i, row in enumerate(rows):
            assert row.state is not None
            try:
                out.append((row, list(row.state.take(logits[i]))))
            except Exception as exc:
                row.cancelled = True
                out.append((row, [exc.with_traceback(None)]))
