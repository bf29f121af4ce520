"""Neurocache (Safaya & Yuret): adapt a pretrained decoder LM with a cache of compressed states.

The base model's decoder layers are replaced in place by explicit wrappers:

- the retrieval layer r runs as before, then projects its output H [B, T, h] with W_p to compressed
  states C [B, T, d] (d = h / compression), normalises them, and looks up the k nearest cached
  states for every token once (each with the `window - 1` states written after it);
- every augmented layer r+1 ... L adds a gated cache-attention branch to its self-attention output:
  queries from the layer's normed input, keys/values projected from the retrieved states of the
  token and of the `context - 1` tokens before it;
- the FFNs of augmented layers get LoRA adapters.

The gate and the LoRA up-projections start at zero, so the adapted model equals the base model
exactly until trained. Without an attached cache every branch is skipped, so one model object
serves cache-less sessions unchanged.
"""

from __future__ import annotations

import hashlib
import inspect
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.memories.neurocache.state_cache import StateCache


@dataclass(frozen=True)
class NeurocacheConfig:
    retrieval_layer: int | None = None  # r; None means 3/4 of the depth
    compression: int = 4  # h / d
    top_k: int = 16  # k
    window: int = 2  # w: each match and the states written after it
    context: int = 2  # c: token i also attends to the retrievals of the c-1 tokens before it
    capacity: int = 16_384  # m, entries per session cache
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] | None = None  # FFN linear names; None: the architecture's defaults
    successor_bias: float = 8.0  # ours: initial score bias on the state written after a token's nearest match

    def __post_init__(self) -> None:
        for name in ("compression", "top_k", "window", "context", "capacity", "lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["lora_targets"] = list(self.lora_targets) if self.lora_targets is not None else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NeurocacheConfig:
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown Neurocache settings {unknown}")
        targets = data.get("lora_targets")
        return cls(**{**data, "lora_targets": tuple(targets) if targets is not None else None})


# ---- architectures ------------------------------------------------------------------------


@dataclass(frozen=True)
class ArchSpec:
    """Where an architecture keeps the parts Neurocache needs."""

    # Hugging Face models and layers are reached by attribute name: they are typed Any
    layers: Callable[[Any], nn.ModuleList]
    attn_norm: str
    ffn_norm: str
    ffn: str
    lora_targets: tuple[str, ...]  # inside the FFN
    attention_weights: Callable[[Any], tuple[torch.Tensor, ...]]  # q, k, v, o as [out, in]
    run_attention: Callable[[Any, torch.Tensor, dict[str, Any]], torch.Tensor]
    heads: Callable[[Any], tuple[int, int]]  # (query heads, key/value heads)


def _llama_weights(layer: Any) -> tuple[torch.Tensor, ...]:
    a = layer.self_attn
    return a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight


def _llama_attention(layer: Any, x: torch.Tensor, args: dict[str, Any]) -> torch.Tensor:
    extra = args.pop("kwargs", {})
    return layer.self_attn(hidden_states=x, **args, **extra)[0]


def _gpt2_weights(layer: Any) -> tuple[torch.Tensor, ...]:
    fused = layer.attn.c_attn.weight.T  # Conv1D keeps [in, out]; as [3h, h]
    q, k, v = fused.chunk(3, dim=0)
    return q, k, v, layer.attn.c_proj.weight.T


def _gpt2_attention(layer: Any, x: torch.Tensor, args: dict[str, Any]) -> torch.Tensor:
    if args.get("encoder_hidden_states") is not None:
        raise ValueError("Neurocache does not support GPT-2 cross-attention")
    extra = args.pop("kwargs", {})
    keep = ("past_key_values", "attention_mask", "use_cache")
    return layer.attn(x, **{k: args[k] for k in keep if k in args}, **extra)[0]


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(
        layers=lambda m: m.model.layers,
        attn_norm="input_layernorm",
        ffn_norm="post_attention_layernorm",
        ffn="mlp",
        lora_targets=("gate_proj", "up_proj", "down_proj"),
        attention_weights=_llama_weights,
        run_attention=_llama_attention,
        heads=lambda c: (c.num_attention_heads, c.num_key_value_heads),
    ),
    "gpt2": ArchSpec(
        layers=lambda m: m.transformer.h,
        attn_norm="ln_1",
        ffn_norm="ln_2",
        ffn="mlp",
        lora_targets=("c_fc", "c_proj"),
        attention_weights=_gpt2_weights,
        run_attention=_gpt2_attention,
        heads=lambda c: (c.n_head, c.n_head),
    ),
}
for _alias in ("mistral", "qwen2", "qwen3"):  # same decoder-layer layout as Llama
    ARCHITECTURES[_alias] = ARCHITECTURES["llama"]


def shapes_digest(model: nn.Module) -> str:
    """A digest of every parameter's name and shape: the base model's structure, not its values."""
    text = ";".join(f"{name}:{tuple(p.shape)}" for name, p in model.named_parameters())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def arch_of(model: Any) -> ArchSpec:
    model_type = model.config.model_type
    if model_type not in ARCHITECTURES:
        raise ValueError(f"Neurocache supports {sorted(ARCHITECTURES)}, not {model_type!r}")
    return ARCHITECTURES[model_type]


# ---- shared retrieval state -----------------------------------------------------------------


@dataclass
class RetrievalState:
    """What one forward pass shares between the retrieval layer and the augmented layers."""

    caches: list[StateCache] | None = None  # one per batch row; None: plain base model
    states: torch.Tensor | None = None  # B, T, c*k*w, d
    mask: torch.Tensor | None = None  # B, T, c*k*w
    compressed: torch.Tensor | None = None  # B, T, d of the last forward, to append after it
    carry: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # last c-1 tokens' retrievals
    compress_only: bool = False  # stop the forward pass once C is known
    reencode: bool = False  # training: caches keep H; retrieved H goes through W_p with gradients
    hidden: torch.Tensor | None = None  # B, T, h of the last forward, when re-encoding


class CompressedStates(Exception):
    """Ends a compress-only forward pass at the retrieval layer, carrying C [B, T, d]."""

    def __init__(self, compressed: torch.Tensor) -> None:
        super().__init__("compressed states ready")
        self.compressed = compressed


# ---- modules -------------------------------------------------------------------------------


class LoRALinear(nn.Module):
    """y = base(x) + (alpha / rank) * B(A(x)); B starts at zero. Wraps nn.Linear or GPT-2's Conv1D.

    The update applies only while a Neurocache binding is active (`shared.caches` set): outside,
    the layer is the base layer, so sessions of other memories sharing the model get the base model.
    Without gradients (serving), it runs as one matmul with a merged copy of the weight, made on
    first use and remade whenever the base or LoRA weights change; the base weight stays as it is."""

    def __init__(self, base: nn.Module, *, rank: int, alpha: float, shared: RetrievalState) -> None:
        super().__init__()
        self.base: Any = base  # nn.Linear or Conv1D
        self._shared = shared
        weight = cast(torch.Tensor, base.weight)
        self._conv1d = type(base).__name__ == "Conv1D"  # weight kept as [in, out]
        in_features, out_features = (weight.shape[0], weight.shape[1]) if self._conv1d else (weight.shape[1], weight.shape[0])
        self.lora_a = nn.Linear(in_features, rank, bias=False, dtype=weight.dtype, device=weight.device)
        self.lora_b = nn.Linear(rank, out_features, bias=False, dtype=weight.dtype, device=weight.device)
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)
        self.scale = alpha / rank
        self._merged: tuple[tuple[int, ...], torch.Tensor] | None = None  # (weight versions, [out, in])

    def outside_binding(self) -> nn.Module:
        """The base layer: what this layer computes while no Neurocache binding is active
        (engine/models/llama_step.py's `Wrapped`)."""
        return cast(nn.Module, self.base)

    def delta(self) -> torch.Tensor:
        """The update as a weight in the base layer's layout."""
        delta = self.scale * (self.lora_b.weight.float() @ self.lora_a.weight.float())  # out, in
        return delta.T if self._conv1d else delta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._shared.caches is None:
            return self.base(x)
        if torch.is_grad_enabled():
            return self.base(x) + self.scale * self.lora_b(self.lora_a(x))
        return F.linear(x, self._merged_weight(), getattr(self.base, "bias", None))

    def _merged_weight(self) -> torch.Tensor:
        weights = (self.base.weight, self.lora_a.weight, self.lora_b.weight)
        versions = tuple(w._version for w in weights) + tuple(w.data_ptr() for w in weights)
        if self._merged is None or self._merged[0] != versions:
            with torch.inference_mode(False), torch.no_grad():
                merged = (self.base.weight.float() + self.delta()).to(self.base.weight.dtype)
            self._merged = (versions, (merged.T if self._conv1d else merged).contiguous())
        return self._merged[1]


class CacheAttention(nn.Module):
    """Attention from a layer's tokens to their retrieved compressed states, gated (closed at init).

    Retrieved states arrive in a fixed layout of slots: for each of the c context tokens, its k
    matches nearest first, each followed by its w-1 successors. A learned score bias per head and
    slot lets a head prefer a slot, e.g. "the state written right after the nearest match", which
    content alone cannot single out: the match and its successor are both similar to the query.
    The bias starts at `successor_bias` on slot 1 (the token's own nearest match's successor) and
    at 0 elsewhere; the closed gate keeps the model equal to the base model whatever the bias.
    This bias is our addition to the paper's cache attention (docs/neurocache.md)."""

    def __init__(
        self,
        weights: tuple[torch.Tensor, ...],
        *,
        heads: int,
        kv_heads: int,
        compressed_dim: int,
        slots: int,
        successor_bias: float = 0.0,
    ) -> None:
        super().__init__()
        q_w, k_w, v_w, o_w = (w.detach() for w in weights)
        self.heads, self.kv_heads = heads, kv_heads
        self.head_dim = q_w.shape[0] // heads
        self.q = nn.Linear(q_w.shape[1], q_w.shape[0], bias=False, dtype=q_w.dtype, device=q_w.device)
        self.k = nn.Linear(compressed_dim, k_w.shape[0], bias=False, dtype=k_w.dtype, device=k_w.device)
        self.v = nn.Linear(compressed_dim, v_w.shape[0], bias=False, dtype=v_w.dtype, device=v_w.device)
        self.o = nn.Linear(o_w.shape[1], o_w.shape[0], bias=False, dtype=o_w.dtype, device=o_w.device)
        with torch.no_grad():
            self.q.weight.copy_(q_w)
            self.o.weight.copy_(o_w)
            self.k.weight.copy_(k_w[:, :compressed_dim])  # the matching slice of the input dimensions
            self.v.weight.copy_(v_w[:, :compressed_dim])
        self.gate = nn.Parameter(torch.zeros(heads, dtype=torch.float32, device=q_w.device))
        self.slot_bias = nn.Parameter(torch.zeros(heads, slots, dtype=torch.float32, device=q_w.device))
        if slots > 1:  # slot 1: the token's own nearest match's successor (with w >= 2)
            with torch.no_grad():
                self.slot_bias[:, 1] = successor_bias

    def forward(self, x: torch.Tensor, states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv, hd = self.heads, self.kv_heads, self.head_dim
        # The key and value projections are folded into the query and the output instead of being
        # applied to each of the R retrieved states: q.(W_k s) = (W_k^T q).s, and
        # sum_r a_r W_v s_r = W_v (sum_r a_r s_r). Per token that is ~H*hd*d multiply-adds twice
        # instead of R*d*Hkv*hd twice (10x fewer for R = 64), and all of it runs in float32.
        retrieved = states.float()  # B, T, R, d
        # query heads grouped by the key/value head they share (GQA): query head h uses key/value
        # head h // (H / Hkv), so the projections are never repeated per query head
        q = self.q(x).float().view(B, T, Hkv, H // Hkv, hd)
        query = torch.einsum("btkge,ked->btkgd", q, self._per_kv_head(self.k.weight)).reshape(B, T, H, -1)  # B, T, H, d
        scores = query @ retrieved.transpose(-1, -2) / math.sqrt(hd)  # B, T, H, R
        scores = scores + self.slot_bias
        scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a token with nothing retrieved gets zeros
        mixed = (weights @ retrieved).view(B, T, Hkv, H // Hkv, -1)  # B, T, Hkv, G, d
        out = torch.einsum("btkgd,ked->btkge", mixed, self._per_kv_head(self.v.weight)).reshape(B, T, H, hd)
        out = out * torch.tanh(self.gate).view(1, 1, -1, 1)
        return self.o(out.reshape(B, T, -1).to(x.dtype))

    def _per_kv_head(self, weight: torch.Tensor) -> torch.Tensor:
        """A key or value projection [Hkv * hd, d] as float32 [Hkv, hd, d]."""
        return weight.float().view(self.kv_heads, self.head_dim, -1)


class AugmentedLayer(nn.Module):
    """A pre-norm decoder layer whose attention output also receives gated cache attention."""

    def __init__(self, base: nn.Module, arch: ArchSpec, cache_attention: CacheAttention, shared: RetrievalState) -> None:
        super().__init__()
        self.base = base
        self.cache_attention = cache_attention
        self._arch = arch
        self._shared = shared
        self._signature = inspect.signature(type(base).forward)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        bound = self._signature.bind(self.base, hidden_states, *args, **kwargs).arguments
        bound.pop("self"), bound.pop("hidden_states")
        x = getattr(self.base, self._arch.attn_norm)(hidden_states)
        h = hidden_states + self._arch.run_attention(self.base, x, bound)
        shared = self._shared
        if shared.caches is not None and shared.states is not None:
            h = h + self.cache_attention(x, shared.states, shared.mask)
        ffn = getattr(self.base, self._arch.ffn)
        return h + ffn(getattr(self.base, self._arch.ffn_norm)(h))


class RetrievalLayer(nn.Module):
    """Layer r: runs as before, then compresses its output and retrieves once for every token."""

    def __init__(self, base: nn.Module, projection: nn.Module, config: NeurocacheConfig, shared: RetrievalState) -> None:
        super().__init__()
        self.base = base
        self.projection = projection
        self._config = config
        self._shared = shared

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.base(hidden_states, *args, **kwargs)
        shared = self._shared
        if shared.caches is None:
            return out
        compressed = self.projection(out)  # B, T, d
        shared.compressed = compressed.detach()
        if shared.compress_only:  # ingestion needs C alone: nothing above this layer reads it
            raise CompressedStates(compressed.detach())
        reencode = self.projection if shared.reencode else None
        shared.states, shared.mask = retrieve_with_context(shared, compressed.detach(), self._config, reencode)
        shared.hidden = out.detach() if shared.reencode else None
        return out


def compress_norm(dim: int, *, device: torch.device, dtype: torch.dtype) -> nn.Module:
    return nn.LayerNorm(dim, elementwise_affine=False, device=device, dtype=dtype)


class Projection(nn.Module):
    """W_p then normalisation: h -> d."""

    def __init__(self, hidden: int, compressed: int, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, compressed, bias=False, device=device, dtype=dtype)
        self.norm = compress_norm(compressed, device=device, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(hidden))


def retrieve_with_context(
    shared: RetrievalState,
    compressed: torch.Tensor,
    config: NeurocacheConfig,
    reencode: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Retrieve k*w states per token from each row's cache, then give token i the retrievals of
    tokens i-c+1 ... i (carried over from the previous forward where they came before it).
    With `reencode`, the retrieved entries are the caches' kept hidden states passed through it."""
    rows_states, rows_mask = [], []
    for row, cache in enumerate(shared.caches or []):
        found = cache.search(compressed[row].float(), config.top_k, config.window)
        mask_row = found.mask.to(compressed.device)
        if reencode is not None:
            assert found.values is not None, "re-encoding needs caches that keep values"
            row_states = reencode(found.values.to(compressed.device, compressed.dtype)).float() * mask_row[..., None]
        else:
            row_states = found.states.to(compressed.device, torch.float32)
        rows_states.append(row_states)
        rows_mask.append(mask_row)
    states, mask = torch.stack(rows_states), torch.stack(rows_mask)  # B, T, k*w, d
    T = compressed.shape[1]
    history = config.context - 1
    if shared.carry and history:
        prev_states = torch.cat([s for s, _ in shared.carry], dim=1)  # B, P, kw, d
        prev_mask = torch.cat([m for _, m in shared.carry], dim=1)
    else:
        prev_states, prev_mask = states[:, :0], mask[:, :0]
    all_states = torch.cat([prev_states, states], dim=1)  # B, P+T, kw, d
    all_mask = torch.cat([prev_mask, mask], dim=1)
    P = prev_states.shape[1]
    shifted_states, shifted_mask = [], []
    for offset in range(config.context):  # token i gets the retrievals of token i - offset
        start = P - offset
        if start >= 0:
            shifted_states.append(all_states[:, start : start + T])
            shifted_mask.append(all_mask[:, start : start + T])
        else:
            pad = -start
            shifted_states.append(F.pad(all_states[:, : T - pad], (0, 0, 0, 0, pad, 0)))
            shifted_mask.append(F.pad(all_mask[:, : T - pad], (0, 0, pad, 0), value=False))
    if history:
        shared.carry = [(all_states[:, -history:], all_mask[:, -history:])]
    return torch.cat(shifted_states, dim=2), torch.cat(shifted_mask, dim=2)  # B, T, c*k*w, (d)


@dataclass
class CacheBinding:
    """One request's view of Neurocache: its caches and its carried retrieval context."""

    caches: list[StateCache]
    carry: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    record: list[torch.Tensor] | None = None  # a list: C [B, T, d] of every forward pass, in order


# ---- the adapted model ----------------------------------------------------------------------


class Neurocache(nn.Module):
    """Owns the adapter modules and the layers it wrapped inside `model` (which it modifies in place)."""

    def __init__(self, model: Any, config: NeurocacheConfig) -> None:
        super().__init__()
        arch = arch_of(model)
        layers = arch.layers(model)
        depth = len(layers)
        retrieval_layer = config.retrieval_layer if config.retrieval_layer is not None else (3 * depth) // 4 - 1
        if not 0 <= retrieval_layer < depth - 1:
            raise ValueError(f"retrieval_layer must be in [0, {depth - 2}] for a {depth}-layer model")
        self.config = NeurocacheConfig.from_dict({**config.to_dict(), "retrieval_layer": retrieval_layer})
        self.base_shapes = shapes_digest(model)  # before any layer is wrapped
        self.model = [model]  # a list keeps the base model out of this module's parameters
        self.shared = RetrievalState()
        hidden = int(model.config.hidden_size)
        if hidden % config.compression:
            raise ValueError(f"hidden size {hidden} is not divisible by compression {config.compression}")
        self.compressed_dim = hidden // config.compression
        weight = next(model.parameters())
        self.projection = Projection(hidden, self.compressed_dim, device=weight.device, dtype=weight.dtype)
        heads, kv_heads = arch.heads(model.config)
        targets = config.lora_targets if config.lora_targets is not None else arch.lora_targets
        self.cache_attention = nn.ModuleDict()
        self.lora = nn.ModuleDict()
        layers[retrieval_layer] = RetrievalLayer(layers[retrieval_layer], self.projection, self.config, self.shared)
        for index in range(retrieval_layer + 1, depth):
            base = layers[index]
            attention = CacheAttention(
                arch.attention_weights(base),
                heads=heads,
                kv_heads=kv_heads,
                compressed_dim=self.compressed_dim,
                slots=config.context * config.top_k * config.window,
                successor_bias=config.successor_bias if config.window > 1 else 0.0,
            )
            self.cache_attention[str(index)] = attention
            ffn = getattr(base, arch.ffn)
            for name in targets:
                lora = LoRALinear(getattr(ffn, name), rank=config.lora_rank, alpha=config.lora_alpha, shared=self.shared)
                setattr(ffn, name, lora)
                self.lora[f"{index}_{name}"] = lora
            layers[index] = AugmentedLayer(base, arch, attention, self.shared)
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        for parameter in self.adapter_parameters():
            parameter.requires_grad_(True)

    def loras(self) -> dict[str, LoRALinear]:
        return {name: cast(LoRALinear, lora) for name, lora in self.lora.items()}

    def adapter_parameters(self) -> Iterator[nn.Parameter]:
        yield from self.projection.parameters()
        yield from self.cache_attention.parameters()
        for lora in self.loras().values():
            yield from lora.lora_a.parameters()
            yield from lora.lora_b.parameters()

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """Only the trained parameters (W_p, cache attention with gates, LoRA), by stable names."""
        state = {f"projection.{k}": v for k, v in self.projection.state_dict().items()}
        state.update({f"cache_attention.{k}": v for k, v in self.cache_attention.state_dict().items()})
        for name, lora in self.loras().items():
            state[f"lora.{name}.a"] = lora.lora_a.weight
            state[f"lora.{name}.b"] = lora.lora_b.weight
        return {k: v.detach() for k, v in state.items()}

    def load_adapter_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Strict: every expected tensor present with its shape, nothing unexpected."""
        expected = self.adapter_state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"adapter mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, tensor in state.items():
            if tensor.shape != expected[name].shape:
                raise ValueError(f"adapter tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}")
        with torch.no_grad():
            self.projection.load_state_dict({k[11:]: v for k, v in state.items() if k.startswith("projection.")})
            self.cache_attention.load_state_dict({k[16:]: v for k, v in state.items() if k.startswith("cache_attention.")})
            for name, lora in self.loras().items():
                lora.lora_a.weight.copy_(state[f"lora.{name}.a"])
                lora.lora_b.weight.copy_(state[f"lora.{name}.b"])

    @contextmanager
    def active(self, binding: CacheBinding) -> Iterator[RetrievalState]:
        """Forward passes inside use the binding's caches (one per batch row) and carry its
        retrieval context on; outside, the model is the base model. Requests sharing the model
        each keep their own binding, so their steps may interleave. With `binding.record` a list,
        each pass's compressed states are appended to it (what a remembered turn writes)."""
        shared = self.shared
        shared.caches, shared.carry = binding.caches, binding.carry
        try:
            yield shared
        finally:
            binding.carry = shared.carry
            if binding.record is not None and shared.compressed is not None:
                binding.record.append(shared.compressed)
            shared.caches, shared.states, shared.mask, shared.compressed, shared.carry = None, None, None, None, []

    @contextmanager
    def attached(self, caches: list[StateCache]) -> Iterator[RetrievalState]:
        """`active` with a fresh binding: one sequence's forward passes."""
        with self.active(CacheBinding(caches)) as shared:
            yield shared

    @torch.inference_mode()
    def compress(self, input_ids: torch.Tensor) -> torch.Tensor:
        """C [B, T, d] for a segment: the base model up to layer r and W_p, nothing above."""
        shared = self.shared
        shared.caches, shared.compress_only = [], True
        try:
            self.model[0](input_ids=input_ids)
        except CompressedStates as done:
            return done.compressed
        finally:
            shared.caches, shared.compress_only, shared.compressed = None, False, None
        raise RuntimeError("the retrieval layer was never reached")

    def cache_bytes(self, capacity: int | None = None) -> int:
        """Bytes `new_cache(capacity=...)` allocates."""
        weight = next(self.projection.parameters())
        return StateCache.bytes_for(capacity or self.config.capacity, self.compressed_dim, weight.dtype)

    def new_cache(self, *, capacity: int | None = None, device: torch.device | str | None = None) -> StateCache:
        """A serving cache. States are stored in the projection's dtype, the dtype they are
        computed in, so a bfloat16 model's cache holds them losslessly at 2 bytes a number."""
        weight = next(self.projection.parameters())
        return StateCache(
            capacity=capacity or self.config.capacity, dim=self.compressed_dim, device=device or weight.device, dtype=weight.dtype
        )
