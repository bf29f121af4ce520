"""Segment-selection attention over a pretrained Llama-family model's own keys and values.

CacheFormer's cache attention and the segment-selection KV cache, applied to a served model
without training (the CacheFormer paper's cache attention and the segment-selection key/value
cache paper's top-k segments chosen by their summaries). A document
is fed through the model chunk by chunk; each layer keeps every token's key (before rotary) and
value in a `KVStore`, cut into segments of l tokens with a summary each. A query chunk attends, in
one softmax, to

    [attention sinks | top-k selected segments (+ neighbours) | local window | its own tokens (causal)]

Selection (per layer and key/value head): the mean query of the chunk's rows and of the head's
query group, before rotary, dotted with each segment's summary (the best of its representative
keys), or, while answering with `selection` "keys", each segment's best stored key against any
query row (the attention logit, with rotary as if the key sat in the middle of the selected
region: docs/kvcache.md); top-k segments, each with its u - 1 neighbours
(u = `neighbours`, centred), deduplicated, only among segments that end before the local window
(never the current or a future segment). With `vote` the answer's prompt pass runs twice, the
second attending in every layer the segments the first's selections ranked highest most often;
with `selection` "text" the answer attends, in every layer, segments chosen outside (the
kvcache memory's text index), with `reread` their keys and values computed again from their
tokens after the sinks rather than read from the store.
While a document is fed, chunk g is selected for by the queries of chunk g-1, so no stored key or
value depends on a later token. In the answer's prompt pass chunk g uses its own queries: every
selectable segment precedes the whole prompt, and only the last position's logits are used. A
decode step that reselects (every `reselect_every`-th, the first included; none with 0, which
keeps the prompt pass's last picks, as given picks are kept) does so with its own query; on CPU
the decode steps run as the model's C step (`SelectiveAnswer`).

Positions (rotary): keys are stored before rotary and rotated where they are attended. Sinks sit
at 0..s-1; the current region (window, then the chunk) continues from `sinks + max_selected`,
where `max_selected` = min(segments eligible, k·u)·l (fewer picks given: their count·l); a head's selected segments sit right before
the window, in document order, back to back. With nothing to select the positions are the
document's own, so a text that fits in sinks + window gives the plain model's logits, and so does
a top-k that covers every segment.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import CausalBias, causal_lower_right
from transformers import PretrainedConfig

from engine.memories.kvcache.store import KVStore, StoreShape
from engine.models.llama_parts import Backbone, Layer, NormedAttention
from engine.models.native_step import CACHE_DTYPE, NativeStep
from engine.models.rope import apply_rope as rotate

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
REREAD_ROWS = 1024  # pick rows a pass of `reread` takes at most (a fed chunk's size: what its attention allocates is bounded; the last pass adds the prompt's first chunk)


@dataclass(frozen=True)
class SelectConfig:
    """The model-level layout and selection (tests and research use these defaults; a served
    session's defaults are `engine.memories.kvcache.memory.KVCacheOptions`')."""

    segment_len: int = 64  # l
    top_k: int = 8  # k
    neighbours: int = 3  # u: segments per pick, centred on it
    window: int = 1024  # local window, tokens
    sinks: int = 64  # attention-sink tokens
    query_chunk: int = 64  # p: prompt rows that share one selection
    reselect_every: int = 8  # decode steps that share one selection (each made with its first step's query); 0: none reselects
    ingest_selection: bool = True  # fed chunks attend to selected segments too
    summary: str = "mean"  # "mean" | "representative"
    representatives: int = 4  # keys per segment for "representative"
    query_pool: str = "mean"  # answering: "mean" (the chunk's mean query) | "max" (its best query row)
    selection: str = (
        "summary"  # answering: "summary" (against summaries) | "keys" (each segment's best key) | "text" (picks given)
    )
    vote: bool = False  # answering: the prompt pass twice, the second with the segments the first picked most, in every layer
    reread: bool = False  # answering, picks given: their tokens run again (the kvcache memory then hands them over)

    @property
    def max_selected_tokens(self) -> int:
        return self.top_k * self.neighbours * self.segment_len

    def places(self, eligible: int) -> int:
        """Segments each head attends when `eligible` can be selected: min(k·u, eligible)."""
        return min(eligible, self.top_k * self.neighbours)

    def positions(self) -> int:
        """Positions the layout takes before the answer's own tokens, at most."""
        return self.sinks + self.max_selected_tokens + self.window + self.segment_len


def pick_segments(scores: torch.Tensor, eligible: int, top_k: int, neighbours: int) -> list[list[int]]:
    """Per head, sorted distinct segment indices among the first `eligible` of scores [H, S]: the
    top-k, each with its neighbours; where neighbours overlap, the next best segments fill the
    places, so every head holds min(k·u, eligible) segments (one layout, no padding). Nothing at
    or after `eligible` is ever picked."""
    if eligible <= 0:
        return [[] for _ in range(scores.shape[0])]
    want = min(top_k * neighbours, eligible)
    order = scores[:, :eligible].argsort(dim=-1, descending=True, stable=True)[:, :want].tolist()
    low, high = -((neighbours - 1) // 2), neighbours // 2
    picks = []
    for ranked in order:
        chosen = {p + o for p in ranked[:top_k] for o in range(low, high + 1) if 0 <= p + o < eligible}
        for p in ranked[top_k:]:
            if len(chosen) >= want:
                break
            chosen.add(p)
        picks.append(sorted(chosen))
    return picks


class SelectiveModel:
    """A Llama-family causal LM run with segment-selection attention (module docstring)."""

    def __init__(self, model: nn.Module, config: SelectConfig, native: NativeStep | None = None) -> None:
        """`native`: the model's C decode step (engine/models/llama_step.py's `native_step`), which then
        takes every decode step of an answer (`SelectiveAnswer`); None: every step in torch."""
        cfg = cast(PretrainedConfig, model.config)
        if cfg.model_type not in ARCHITECTURES:
            raise ValueError(f"memory 'kvcache' runs Llama-family models ({', '.join(ARCHITECTURES)}), not {cfg.model_type!r}")
        self.model, self.config, self.native = model, config, native
        self.q_heads: int = cfg.num_attention_heads
        self.kv_heads: int = cfg.num_key_value_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.q_heads
        # a Neurocache adapter wraps some layers; outside its binding they compute the base layer
        self.layers = [cast(Layer, getattr(layer, "base", layer)) for layer in self._backbone.layers]
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        # an answer's buffers: what the C step reads (float32 whatever the model), else the compute dtype
        self.answer_dtype = CACHE_DTYPE if native is not None else self.dtype
        # cos, sin of the selected region, kept while it stays where it is: (window position, width, dtype) -> them
        self._selected_rope: tuple[tuple[int, int, torch.dtype | None], tuple[torch.Tensor, torch.Tensor]] | None = None
        # CPU: a pass's causal masks, shared by its layers (`_causal_mask`): (rows, keys, dtype) -> mask
        self._masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    @property
    def _backbone(self) -> Backbone:
        return cast(Backbone, self.model.model)

    @property
    def _lm_head(self) -> nn.Linear:
        return cast(nn.Linear, self.model.lm_head)

    def store_shape(self, storage: str) -> StoreShape:
        c = self.config
        return StoreShape(
            layers=len(self.layers),
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            sinks=c.sinks,
            segment_len=c.segment_len,
            representatives=c.representatives if c.summary == "representative" else 1,
            storage=storage,
        )

    # ---- pieces of a layer ---------------------------------------------------------------------

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*positions.shape, D] in `dtype` (default: the compute dtype)."""
        flat = positions.reshape(1, positions.numel()).to(self.device)
        probe = torch.empty(0, device=self.device, dtype=dtype or self.dtype)
        cos, sin = self._backbone.rotary_emb(probe, flat)
        return cos.view(*positions.shape, cos.shape[-1]), sin.view(*positions.shape, sin.shape[-1])

    def _project(self, layer: Layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [Hq, T, D], keys and values [T, Hkv, D], all before rotary."""
        T = x.shape[0]
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = a.q_proj(h).view(T, self.q_heads, self.head_dim)
        k = a.k_proj(h).view(T, self.kv_heads, self.head_dim)
        v = a.v_proj(h).view(T, self.kv_heads, self.head_dim)
        if hasattr(a, "q_norm"):  # Qwen3 normalises each head before rotary
            normed = cast(NormedAttention, a)
            q, k = normed.q_norm(q), normed.k_norm(k)
        return q.transpose(0, 1), k, v

    def _query_mean(self, q: torch.Tensor) -> torch.Tensor:
        """[Hkv, D]: the mean over a chunk's rows and each key/value head's query group, float32."""
        return q.float().reshape(self.kv_heads, -1, self.head_dim).mean(dim=1)

    def summaries(self, layer_index: int, store: KVStore, eligible: int) -> torch.Tensor:
        """[S, R, Hkv, D]: the eligible segments' summaries, centred on their mean and scaled to unit
        length. Raw dot products favour the segments near the start of what was fed, whose keys share
        a large common component with every query (measured: docs/kvcache.md)."""
        summaries = store.summaries[layer_index][:eligible]
        centred = summaries - summaries.mean(dim=(0, 1), keepdim=True)
        return centred / centred.norm(dim=-1, keepdim=True).clamp_min(1e-6)

    @staticmethod
    def scores(summaries: torch.Tensor, query_mean: torch.Tensor) -> torch.Tensor:
        """[Hkv, S]: each segment's best summary row against the head's mean query [Hkv, D]."""
        return torch.einsum("srhd,hd->hsr", summaries, query_mean).amax(dim=-1)

    def answer_scores(self, summaries: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """[Hkv, S] for queries q [Hq, T, D] while answering: against their mean (`query_pool`
        "mean"), or each segment's best against any one query row of the head's group, the rows
        scaled to unit length ("max")."""
        if self.config.query_pool == "mean":
            return self.scores(summaries, self._query_mean(q))
        rows = F.normalize(q.float().reshape(self.kv_heads, -1, self.head_dim), dim=-1)  # Hkv, G·T, D
        return torch.einsum("srhd,hqd->hsrq", summaries, rows).flatten(2).amax(dim=-1)

    def key_scores(self, store: KVStore, layer_index: int, eligible: int, q: torch.Tensor, distance: int) -> torch.Tensor:
        """[Hkv, S] for queries q [Hq, T, D] (before rotary) while answering: each eligible
        segment's largest attention logit (unscaled) between any of its stored keys and any query
        row of the head's group, with the keys placed `distance` positions before the first row
        (where the selected region sits). Rotary makes the logit of a query at m and a key at n
        depend on m - n alone, so the rows are rotated by distance + t and the stored keys not at
        all. Reads every key of those segments (`KVStore.best_key_logits`)."""
        cos, sin = self._rope(torch.arange(distance, distance + q.shape[1]), torch.float32)
        rows = rotate(q.float(), cos, sin).reshape(self.kv_heads, -1, self.head_dim)  # Hkv, G·T, D
        return store.best_key_logits(layer_index, eligible, rows)

    def _selected(
        self, layer_index: int, store: KVStore, picks: list[list[int]], window_position: int, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values [Hkv, n·l, D] of each head's n picks, placed back to back right
        before `window_position`, in document order; rotated in `dtype` (default: the compute dtype)."""
        l, D = self.config.segment_len, self.head_dim
        width = len(picks[0]) * l
        if not width:
            empty = torch.zeros(self.kv_heads, 0, D, device=self.device, dtype=self.dtype)
            return empty, empty
        keys, values = store.head_segments(layer_index, picks)  # Hkv, n·l, D
        cached = self._selected_rope
        if cached is None or cached[0] != (window_position, width, dtype):
            cached = self._selected_rope = (
                (window_position, width, dtype),
                self._rope(torch.arange(window_position - width, window_position), dtype),
            )
        return rotate(keys, *cached[1]), values

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q [Hq, T, D] over keys/values [Hkv, L, D], the queries being the last T keys' tokens
        (causal, aligned to the lower right); -> [T, Hq·D]."""
        Hq, T, D = q.shape
        if T == 1:  # a decode step: each key/value head's query group as rows (bf16 SDPA with GQA is slow on CPU)
            grouped = q.reshape(self.kv_heads, Hq // self.kv_heads, D)
            weights = torch.softmax((grouped @ keys.transpose(1, 2)).float() * D**-0.5, dim=-1).to(values.dtype)
            return (weights @ values).reshape(1, Hq * D)
        mask = self._causal_mask(T, keys.shape[1], q.dtype)
        out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, enable_gqa=True)[0]
        return out.transpose(0, 1).reshape(T, -1)

    def _causal_mask(self, rows: int, keys: int, dtype: torch.dtype) -> torch.Tensor | CausalBias:
        """Row i sees the keys up to keys - rows + i (causal, aligned to the lower right). On CPU an
        additive mask [rows, keys] in `dtype`, kept until the pass ends (`_end_pass`) so its layers
        share it: built in each layer it cost about 8% of a document's feeding (bf16, 2 cores).
        Elsewhere torch's lower-right bias, which CUDA kernels apply without a mask in memory."""
        if self.device.type != "cpu":
            return causal_lower_right(rows, keys)
        mask = self._masks.get((rows, keys, dtype))
        if mask is None:
            visible = torch.ones(rows, keys, dtype=torch.bool, device=self.device).tril(keys - rows)
            mask = torch.zeros(rows, keys, dtype=dtype, device=self.device).masked_fill(~visible, float("-inf"))
            self._masks[(rows, keys, dtype)] = mask
        return mask

    def _end_pass(self) -> None:
        self._masks = {}  # a session keeps its model between passes: not the masks

    def _finish_layer(self, layer: Layer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = x + layer.self_attn.o_proj(attended)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self._lm_head(self._backbone.norm(x[-1:]))[0]

    # ---- feeding a document -------------------------------------------------------------------

    def eligible(self, store: KVStore, before: int) -> int:
        """Segments that end before the local window of a chunk starting at fed token `before`."""
        return max(0, (before - self.config.window - self.config.sinks) // self.config.segment_len)

    @torch.inference_mode()
    def feed(self, store: KVStore, token_ids: list[int], *, logits: bool = False) -> torch.Tensor | None:
        """Run the document's next chunk through the model and write its keys/values; with `logits`, return the
        chunk's logits [T, V] (tests compare them; ingestion skips the vocabulary projection)."""
        c = self.config
        start = store.tokens
        sinks = min(c.sinks, start)
        eligible = self.eligible(store, start)
        window_start = c.sinks + eligible * c.segment_len if start > c.sinks else start
        select = c.ingest_selection and eligible > 0 and store.query_mean[0] is not None
        max_selected = c.places(eligible) * c.segment_len if select else 0
        window_position = sinks + max_selected
        T = len(token_ids)
        offset = start if start <= c.sinks else window_position + start - window_start
        own_rope = self._rope(torch.arange(offset, offset + T))
        sink_rope = self._rope(torch.arange(sinks))
        window_rope = (
            self._rope(torch.arange(window_position, window_position + start - window_start)) if start > c.sinks else None
        )
        x = self._backbone.embed_tokens(torch.tensor(token_ids, device=self.device))
        means = []
        for i, layer in enumerate(self.layers):
            q, k, v = self._project(layer, x)
            parts_k = [rotate(store.sink_k[i].transpose(0, 1), *sink_rope)]
            parts_v = [store.sink_v[i].transpose(0, 1)]
            if select:
                query_mean = store.query_mean[i]
                assert query_mean is not None  # `select` holds only once the store has its query means
                scores = self.scores(self.summaries(i, store, eligible), query_mean)
                picks = pick_segments(scores, eligible, c.top_k, c.neighbours)
                selected_k, selected_v = self._selected(i, store, picks, window_position)
                parts_k.append(selected_k)
                parts_v.append(selected_v)
            if start > c.sinks:
                assert window_rope is not None
                window_k, window_v = store.read(i, window_start, start)
                parts_k.append(rotate(window_k.transpose(0, 1), *window_rope))
                parts_v.append(window_v.transpose(0, 1))
            keys = torch.cat([*parts_k, rotate(k.transpose(0, 1), *own_rope)], 1)
            values = torch.cat([*parts_v, v.transpose(0, 1)], 1)
            attended = self._attend(rotate(q, *own_rope), keys, values)
            mean = self._query_mean(q)
            received = torch.einsum("thd,hd->th", k.float(), mean) if c.summary == "representative" else None
            store.write(i, k, v, received)
            means.append(mean)
            x = self._finish_layer(layer, x, attended)
        store.advance(T, means)
        self._end_pass()
        return self._lm_head(self._backbone.norm(x)) if logits else None


class SelectiveAnswer:
    """One answer over a store: the prompt, then one token a step, each attending to sinks, its
    selected segments and the current region (window + prompt + answer so far). Read-only on the
    store. `picked` counts, per segment, the layers that selected it in the prompt pass.

    Each layer keeps one buffer [Hkv, sinks + selected + window + new tokens, D] of rotated keys
    (and values), all layers in one tensor [layers, Hkv, ..., D]: a step writes its own key in
    place and rewrites the selected region only when its picks change (with `pick_tokens`, once,
    from those tokens: in passes of `REREAD_ROWS`, the last as the first rows of the prompt's first pass). With the model's C step
    (`SelectiveModel.native`) a decode step is one C call over those buffers: a step that keeps
    its selection (all but every `reselect_every`-th; all with 0 or given picks) is a plain decode step there, and one that
    reselects does it in each layer from the C step's queries, before that layer attends."""

    def __init__(
        self,
        selective: SelectiveModel,
        store: KVStore,
        new_tokens: int,
        picks: list[int] | None = None,
        pick_tokens: list[int] | None = None,
    ) -> None:
        """`new_tokens`: the most tokens this answer will feed (prompt and answer). `picks`: the
        segments every layer and head attends, chosen outside (`selection` "text"), in place of
        selecting: at most min(k·u, eligible), each eligible; with fewer the selected region is
        shorter and the window follows them. `pick_tokens`: the sorted picks' token ids, l each
        (`reread`): their keys and values are computed again from these (`_reread`), not read
        from the store."""
        self.m, self.store = selective, store
        c = selective.config
        N = store.tokens
        self.sinks = min(c.sinks, N)
        self.eligible = selective.eligible(store, N)
        window_start = c.sinks + self.eligible * c.segment_len if N > c.sinks else N
        want = c.places(self.eligible)
        if picks is not None and not (len(set(picks)) == len(picks) <= want and all(0 <= p < self.eligible for p in picks)):
            raise ValueError(f"picks must be at most {want} distinct segments below {self.eligible}")
        self.window_position = self.sinks + (want if picks is None else len(picks)) * c.segment_len
        window = N - window_start if N > c.sinks else 0
        self._prompt_picks: list[set[int]] = [set() for _ in selective.layers]
        self.selection_seconds = 0.0
        self.prompt_selection_seconds = 0.0  # what the prompt pass spent selecting
        self._prompt_done = False
        self._picks: list[list[list[int]] | None] = [None] * len(selective.layers)
        self._summaries: list[torch.Tensor | None] = [None] * len(selective.layers)
        self._steps = 0  # decode steps fed
        self._fixed = None if picks is None else sorted(picks)  # what every layer and head attends: given, or voted
        self._given = picks is not None
        if picks is None and c.selection == "text":
            raise ValueError('selection "text" needs the picks given')
        self._votes = self._tiebreak = torch.zeros(0)  # with `vote`, the first prompt pass's
        self._voting = False  # the first prompt pass of `vote` is running
        H, D, size = selective.kv_heads, selective.head_dim, self.window_position + window + new_tokens
        sink_rope = selective._rope(torch.arange(self.sinks), selective.answer_dtype)
        window_rope = selective._rope(torch.arange(window) + self.window_position, selective.answer_dtype)
        self.keys = torch.zeros(len(selective.layers), H, size, D, device=selective.device, dtype=selective.answer_dtype)
        self.values = torch.zeros_like(self.keys)
        self._k, self._v = list(self.keys.unbind(0)), list(self.values.unbind(0))  # per layer, views
        for i, (keys, values) in enumerate(zip(self._k, self._v, strict=True)):
            keys[:, : self.sinks] = rotate(store.sink_k[i].transpose(0, 1), *sink_rope)
            values[:, : self.sinks] = store.sink_v[i].transpose(0, 1)
            if window:
                wk, wv = store.read(i, window_start, N)
                keys[:, self.window_position : self.window_position + window] = rotate(wk.transpose(0, 1), *window_rope)
                values[:, self.window_position : self.window_position + window] = wv.transpose(0, 1)
        self._length = self.window_position + window  # buffer columns in use; a column is its token's position
        self._pending: tuple[list[int], torch.Tensor] | None = None  # `reread`'s last pass: its tokens and columns
        if pick_tokens is not None:
            if self._fixed is None or len(pick_tokens) != len(self._fixed) * c.segment_len:
                raise ValueError("pick_tokens must be the given picks' tokens, segment_len each")
            self._reread(pick_tokens)

    @torch.inference_mode()
    def _reread(self, pick_tokens: list[int]) -> None:
        """The given picks' keys and values computed again from their tokens, each attending to
        the sinks and the picks before it, written where the stored ones would go; the window and
        the prompt then attend to these. In passes of at most `REREAD_ROWS` rows; the last pass
        waits for the prompt's first chunk and runs with it (`_chunk`): one pass over the weights
        fewer before the first token."""
        fixed = cast(list[int], self._fixed)  # given: the constructor checked
        self._picks = [[fixed] * self.m.kv_heads for _ in self.m.layers]  # `_select` need not read the stored picks
        for at in range(0, len(pick_tokens), REREAD_ROWS):
            rows = pick_tokens[at : at + REREAD_ROWS]
            columns = torch.arange(self.sinks + at, self.sinks + at + len(rows), device="cpu")
            if at + REREAD_ROWS < len(pick_tokens):
                self._rows(rows, columns, keep=0)
            else:
                self._pending = (rows, columns)

    @property
    def picked(self) -> Counter[int]:
        """Segment -> in how many layers the prompt pass selected it."""
        return Counter(s for picks in self._prompt_picks for s in picks)

    @property
    def length(self) -> int:
        """Buffer columns in use (what the C step reads as a row's length)."""
        return self._length

    def _keeps_selection(self) -> bool:
        """Whether the decode step being fed keeps the last step's picks."""
        every = self.m.config.reselect_every
        return self.eligible == 0 or every == 0 or self._given or (self._steps - 1) % every != 0

    @torch.inference_mode()
    def forward(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [V] of the last of `token_ids`, fed after everything fed before."""
        if self._prompt_done:
            self._steps += 1
            if len(token_ids) == 1 and self.m.native is not None:
                return self._native_step(token_ids[0])
        c = self.m.config
        if not self._prompt_done and c.vote and c.places(self.eligible) < self.eligible and not self._given:
            self._vote(token_ids)  # (when every segment fits, every layer picks them all: no vote)
        out = self._pass(token_ids)
        if not self._prompt_done:
            self.prompt_selection_seconds = self.selection_seconds
        self._prompt_done = True
        return out

    def _pass(self, token_ids: list[int]) -> torch.Tensor:
        """Feed `token_ids` in chunks of `query_chunk` rows; the last row's logits."""
        chunk = self.m.config.query_chunk
        outs = [self._chunk(token_ids[at : at + chunk]) for at in range(0, len(token_ids), chunk)]
        return outs[-1]

    def _vote(self, token_ids: list[int]) -> None:
        """A first prompt pass, each layer and head selecting as configured, counting per segment
        the (prompt chunk, layer, head) selections that ranked it in their top-k; the prompt pass
        that follows overwrites this one's keys and values and attends, in every layer and head,
        the top-k segments by that count (ties: the larger sum of the segment's scores, each
        selection's centred and scaled to unit spread), with their neighbours, as `pick_segments`
        places them."""
        start = self._length
        self._votes = torch.zeros(self.eligible, device=self.m.device)
        self._tiebreak = torch.zeros(self.eligible, device=self.m.device)
        self._voting = True
        self._pass(token_ids)
        self._voting = False
        spread = self._tiebreak.abs().max().clamp_min(1e-6)
        self._votes = self._votes + 0.25 * self._tiebreak / spread  # ties only: under half a vote
        c = self.m.config
        self._fixed = pick_segments(self._votes[None], self.eligible, c.top_k, c.neighbours)[0]
        self._length = start
        self._picks = [None] * len(self.m.layers)
        self._prompt_picks = [set() for _ in self.m.layers]

    def _count_votes(self, scores: torch.Tensor) -> None:
        """One layer's scores [H, eligible]: a vote for each head's top-k (not their neighbours)."""
        top = scores.topk(min(self.m.config.top_k, scores.shape[1]), dim=-1).indices
        self._votes += torch.bincount(top.flatten(), minlength=scores.shape[1]).float()
        centred = scores - scores.mean(dim=-1, keepdim=True)
        self._tiebreak += (centred / centred.std(dim=-1, keepdim=True).clamp_min(1e-6)).sum(dim=0)

    def _native_step(self, token: int) -> torch.Tensor:
        """One decode step as one C call over the layers' buffers, writing the token's keys and
        values; a step that reselects does so in each layer, from the queries the C step computed."""
        m = self.m
        assert m.native is not None
        hidden = m._backbone.embed_tokens(torch.tensor([token], device=m.device))  # 1, d
        cos, sin = m._rope(torch.tensor([self._length]), CACHE_DTYPE)  # 1, D
        hook = None if self._keeps_selection() else self._select_from_qkv
        logits = m.native(hidden, [self], cos, sin, hook)[0]
        self._length += 1
        return logits

    def _select_from_qkv(self, layer_index: int, qkv: torch.Tensor) -> None:
        """The C step's hook: select with the layer's queries (qkv [1, (Hq + 2 Hkv) D], before rotary)."""
        m = self.m
        self._select(layer_index, qkv[0, : m.q_heads * m.head_dim].view(m.q_heads, 1, m.head_dim))

    def _chunk(self, token_ids: list[int]) -> torch.Tensor:
        """Feed `token_ids` after the buffers' columns in use (after `reread`'s last pass, in the
        same pass); the last row's logits."""
        columns = torch.arange(self._length, self._length + len(token_ids), device="cpu")
        if self._pending is not None:
            assert self._given, "only given picks are read again: no layer scores in this pass"
            (picks, pick_columns), self._pending = self._pending, None
            token_ids, columns = picks + token_ids, torch.cat([pick_columns, columns])
        return self.m.logits(self._rows(token_ids, columns, keep=1))

    def _rows(self, token_ids: list[int], columns: torch.Tensor, *, keep: int) -> torch.Tensor:
        """Feed `token_ids` as the tokens of buffer columns `columns` (their positions, ascending),
        each attending to the columns up to its own, writing their keys and values; the hidden
        states of the last `keep` rows (the last columns in use), for which alone the last layer's
        attention and MLP run (keep 0: `_reread`'s passes, which keep only keys and values; the
        states returned are then all rows' of the last but one layer, and unused). Each
        run of consecutive columns attends as one causal block (a mask over the gaps between runs
        would cost the CPU kernel the attention of every row to every column)."""
        m = self.m
        T, end = len(token_ids), int(columns[-1]) + 1
        breaks = [0, *(torch.nonzero(columns.diff() != 1).flatten() + 1).tolist(), T]
        # rows [a, b) at consecutive columns, seeing the keys before `stop` (one past the run's last column)
        runs = [(a, b, int(columns[b - 1]) + 1) for a, b in zip(breaks, breaks[1:], strict=False)]
        where: slice | torch.Tensor = slice(end - T, end) if len(runs) == 1 else columns
        cos, sin = m._rope(columns)
        x = m._backbone.embed_tokens(torch.tensor(token_ids, device=m.device))
        for i, layer in enumerate(m.layers):
            q, k, v = m._project(layer, x)
            self._select(i, q)
            self._k[i][:, where] = rotate(k.transpose(0, 1), cos, sin).to(self._k[i].dtype)  # (indexing: no implicit cast)
            self._v[i][:, where] = v.transpose(0, 1).to(self._v[i].dtype)
            if i == len(m.layers) - 1:
                if not keep:
                    break
                assert keep <= runs[-1][1] - runs[-1][0], "the rows kept are in the last run"
                q, x, cos, sin, runs = q[:, -keep:], x[-keep:], cos[-keep:], sin[-keep:], [(0, keep, end)]
            keys, values = self._k[i][:, :end].to(q.dtype), self._v[i][:, :end].to(q.dtype)  # float32 buffers for the C step
            rotated = rotate(q, cos, sin)
            attended = [m._attend(rotated[:, a:b], keys[:, :stop], values[:, :stop]) for a, b, stop in runs]
            x = m._finish_layer(layer, x, torch.cat(attended) if len(attended) > 1 else attended[0])
        m._end_pass()
        self._length = max(self._length, end)
        return x

    def _scores(self, layer_index: int, q: torch.Tensor) -> torch.Tensor:
        """[Hkv, eligible]: the layer's scores of the eligible segments for queries q [Hq, T, D]."""
        m = self.m
        if m.config.selection == "keys":
            middle = (self.sinks + self.window_position) // 2  # of the selected region
            return m.key_scores(self.store, layer_index, self.eligible, q, self._length - middle)
        summaries = self._summaries[layer_index]
        if summaries is None:  # the store is read-only while answering
            summaries = self._summaries[layer_index] = m.summaries(layer_index, self.store, self.eligible)
        return m.answer_scores(summaries, q)

    def _select(self, layer_index: int, q: torch.Tensor) -> None:
        m, c = self.m, self.m.config
        if self.eligible == 0:
            return
        if self._prompt_done and self._keeps_selection():
            return
        started = time.perf_counter()
        if self._fixed is not None and not self._voting and not self._prompt_done:
            picks = [self._fixed] * m.kv_heads
        else:
            scores = self._scores(layer_index, q)
            picks = pick_segments(scores, self.eligible, c.top_k, c.neighbours)
            if self._voting:
                self._count_votes(scores)
        if picks != self._picks[layer_index]:  # a step that picks as the last one keeps its rows
            self._picks[layer_index] = picks
            region = slice(self.sinks, self.window_position)
            keys, values = m._selected(layer_index, self.store, picks, self.window_position, m.answer_dtype)
            self._k[layer_index][:, region], self._v[layer_index][:, region] = keys, values
        if not self._prompt_done:
            self._prompt_picks[layer_index].update(s for p in picks for s in p)
        self.selection_seconds += time.perf_counter() - started
