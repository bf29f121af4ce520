"""Neurocache adaptation: closed-gate parity per architecture, causality, one retrieval per token,
cached decoding equal to full recomputation, strict adapter loading."""

from __future__ import annotations

from typing import cast

import pytest
import torch

from engine.memories.neurocache.adapter import CacheAttention, Neurocache, NeurocacheConfig
from research.training.neurocache_adapter import merge_lora, new_training_cache, training_caches
from tests.helpers import ARCHS, CONFIG, VOCAB, adapted, filled_cache, open_gates, tiny


def test_slot_bias_selects_a_retrieval_slot():
    """A large bias on one slot puts all of every head's cache attention on that slot's state."""
    neurocache = Neurocache(tiny("llama"), CONFIG)
    attention = cast(CacheAttention, neurocache.cache_attention["3"])
    slots = attention.slot_bias.shape[1]
    assert slots == CONFIG.context * CONFIG.top_k * CONFIG.window
    initial = torch.zeros_like(attention.slot_bias)
    initial[:, 1] = CONFIG.successor_bias  # the prior: what followed the nearest match
    assert torch.equal(attention.slot_bias.detach(), initial)
    torch.manual_seed(3)
    x = torch.randn(2, 5, 32)
    states = torch.randn(2, 5, slots, neurocache.compressed_dim)
    mask = torch.ones(2, 5, slots, dtype=torch.bool)
    with torch.no_grad():
        attention.gate.fill_(1.0)
        attention.slot_bias.zero_()
        attention.slot_bias[:, 1] = 100.0  # the nearest match's successor, of the token itself
        out = attention(x, states, mask)
        only = attention(x, states[:, :, 1:2].expand_as(states), mask)  # every slot holds slot 1's state
        attention.slot_bias.zero_()
        spread = attention(x, states, mask)
    torch.testing.assert_close(out, only, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, spread, atol=1e-3)


def test_cache_attention_equals_a_per_head_reference():
    """Grouped-query cache attention, written out head by head: query head h reads key/value head
    h // (heads / kv_heads); masked slots get no weight; a token with nothing retrieved gets zero."""
    neurocache = Neurocache(tiny("llama"), CONFIG)  # 4 query heads, 2 key/value heads
    attention = cast(CacheAttention, neurocache.cache_attention["3"])
    torch.manual_seed(4)
    B, T, R, d = 2, 3, attention.slot_bias.shape[1], neurocache.compressed_dim
    x, states = torch.randn(B, T, 32), torch.randn(B, T, R, d)
    mask = torch.rand(B, T, R) > 0.4
    mask[1, 2] = False
    with torch.no_grad():
        attention.gate.normal_(0, 1.0)
        attention.slot_bias.normal_(0, 1.0)
        got = attention(x, states, mask)
        hd, group = attention.head_dim, attention.heads // attention.kv_heads
        expected = torch.zeros(B, T, attention.heads * hd)
        for b in range(B):
            for t in range(T):
                keep = mask[b, t]
                if not keep.any():
                    continue
                for h in range(attention.heads):
                    q = attention.q.weight[h * hd : (h + 1) * hd] @ x[b, t]
                    kv = slice((h // group) * hd, (h // group + 1) * hd)
                    k = states[b, t] @ attention.k.weight[kv].T  # R, hd
                    v = states[b, t] @ attention.v.weight[kv].T
                    scores = k[keep] @ q / hd**0.5 + attention.slot_bias[h][keep]
                    expected[b, t, h * hd : (h + 1) * hd] = torch.tanh(attention.gate[h]) * (torch.softmax(scores, 0) @ v[keep])
        expected = expected @ attention.o.weight.T
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert got[1, 2].abs().max() == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_closed_gate_equals_base_model(arch):
    model, neurocache, reference = adapted(arch)
    ids = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        expected = reference(ids).logits
        without_cache = model(ids).logits
        with neurocache.attached([filled_cache(neurocache), filled_cache(neurocache, seed=3)]):
            with_cache = model(ids).logits
    torch.testing.assert_close(without_cache, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(with_cache, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_open_gate_uses_the_cache_and_detached_model_stays_base(arch):
    model, neurocache, reference = adapted(arch)
    open_gates(neurocache)
    with torch.no_grad():
        for lora in neurocache.lora.values():
            lora.lora_b.weight.zero_()  # isolate the cache branch
    ids = torch.randint(0, VOCAB, (1, 16))
    with torch.no_grad():
        with neurocache.attached([filled_cache(neurocache)]):
            with_cache = model(ids).logits
        with neurocache.attached([neurocache.new_cache()]):  # attached but empty: nothing to attend
            empty = model(ids).logits
        expected = reference(ids).logits
    assert (with_cache - expected).abs().max() > 1e-3
    torch.testing.assert_close(empty, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_trained_lora_applies_only_while_a_cache_is_attached(arch):
    """Sessions of other memories share the adapted model: outside a binding it is the base model."""
    model, neurocache, reference = adapted(arch)
    open_gates(neurocache)  # gates, slot biases and LoRA all away from their initial values
    ids = torch.randint(0, VOCAB, (1, 16))
    with torch.no_grad():
        expected = reference(ids).logits
        detached = model(ids).logits
        with neurocache.attached([neurocache.new_cache()]):  # empty cache: only the LoRA differs
            adapted_logits = model(ids).logits
        after = model(ids).logits
    torch.testing.assert_close(detached, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-6)
    assert (adapted_logits - expected).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("position", [0, 1, 7, 15])
def test_changing_a_token_never_moves_earlier_outputs(arch, position):
    model, neurocache, _ = adapted(arch)
    open_gates(neurocache)
    ids = torch.randint(0, VOCAB, (1, 16))
    changed = ids.clone()
    changed[0, position] = (ids[0, position] + 1) % VOCAB
    cache = filled_cache(neurocache)
    with torch.no_grad():
        with neurocache.attached([cache]):
            a = model(ids).logits
        with neurocache.attached([cache]):
            b = model(changed).logits
    torch.testing.assert_close(a[:, :position], b[:, :position], rtol=0, atol=0)
    if position < 15:
        assert (a[:, position:] - b[:, position:]).abs().max() > 0


def test_one_retrieval_per_token_shared_by_every_augmented_layer():
    model, neurocache, _ = adapted("llama")
    cache = filled_cache(neurocache)
    calls = []
    original = cache.search

    def counting(queries, k, window=1):
        calls.append(queries.shape[0])
        return original(queries, k, window)

    cache.search = counting
    with torch.no_grad(), neurocache.attached([cache]):
        model(torch.randint(0, VOCAB, (1, 12)))
    assert calls == [12]  # one search call for the whole segment, one query per token
    assert len(neurocache.cache_attention) == 1  # 4 layers, r = 2: layer 3 is augmented


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_kv_cached_decoding_equals_full_recomputation(arch):
    model, neurocache, _ = adapted(arch)
    open_gates(neurocache)
    cache = filled_cache(neurocache)
    prompt = torch.randint(0, VOCAB, (1, 10))
    with torch.no_grad():
        full = prompt.clone()
        for _ in range(6):
            with neurocache.attached([cache]):
                full = torch.cat([full, model(full).logits[:, -1:].argmax(-1)], dim=1)
        with neurocache.attached([cache]):
            out = model(prompt, use_cache=True)
            cached = prompt.clone()
            for _ in range(6):
                token = out.logits[:, -1:].argmax(-1)
                cached = torch.cat([cached, token], dim=1)
                out = model(token, past_key_values=out.past_key_values, use_cache=True)
    assert torch.equal(full, cached)


def test_adapter_state_round_trip_and_strict_loading():
    _, neurocache, _ = adapted("llama")
    open_gates(neurocache)
    state = neurocache.adapter_state_dict()
    _, other, _ = adapted("llama")
    other.load_adapter_state_dict(state)
    for name, tensor in other.adapter_state_dict().items():
        assert torch.equal(tensor, state[name]), name
    with pytest.raises(ValueError, match="missing"):
        other.load_adapter_state_dict({k: v for k, v in state.items() if "gate" not in k})
    with pytest.raises(ValueError, match="unexpected"):
        other.load_adapter_state_dict({**state, "extra": torch.zeros(1)})
    bad = dict(state)
    bad["projection.proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="shape"):
        other.load_adapter_state_dict(bad)


def test_only_adapter_parameters_train():
    model, neurocache, _ = adapted("llama")
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in neurocache.adapter_parameters()}
    assert trainable


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="retrieval_layer"):
        Neurocache(tiny("llama"), NeurocacheConfig(retrieval_layer=3))
    with pytest.raises(ValueError, match="compression"):
        Neurocache(tiny("llama"), NeurocacheConfig(compression=5))
    with pytest.raises(ValueError, match="top_k"):
        NeurocacheConfig(top_k=0)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_merged_lora_gives_the_same_logits(arch):
    model, neurocache, _ = adapted(arch)
    open_gates(neurocache)
    ids = torch.randint(0, VOCAB, (1, 12))
    cache = filled_cache(neurocache)
    with torch.no_grad(), neurocache.attached([cache]):
        before = model(ids).logits
    merge_lora(neurocache)
    with torch.no_grad(), neurocache.attached([cache]):
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)
    assert all(float(l.lora_b.weight.detach().abs().max()) == 0 for l in neurocache.lora.values())


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_serving_lora_runs_merged_and_follows_weight_changes(arch):
    """Without gradients each LoRA layer is one matmul with a merged weight copy; it gives the
    logits of the two-path form used in training, and is remade when the weights change."""
    model, neurocache, _ = adapted(arch)
    open_gates(neurocache)
    ids = torch.randint(0, VOCAB, (1, 12))
    cache = filled_cache(neurocache)

    def logits(grad: bool) -> torch.Tensor:
        with torch.set_grad_enabled(grad), neurocache.attached([cache]):
            return model(ids).logits.detach()

    lora = next(iter(neurocache.lora.values()))
    base_weight = lora.base.weight.detach().clone()
    torch.testing.assert_close(logits(False), logits(True), rtol=1e-4, atol=1e-5)
    assert lora._merged is not None
    with torch.no_grad():
        lora.lora_b.weight.mul_(3.0)  # an optimizer step or a loaded adapter writes in place
    changed = logits(False)
    torch.testing.assert_close(changed, logits(True), rtol=1e-4, atol=1e-5)
    assert torch.equal(lora.base.weight, base_weight)  # the base weight itself is never touched


def test_interleaved_requests_keep_their_own_context():
    from engine.memories.neurocache.adapter import CacheBinding

    model, neurocache, _ = adapted("llama")
    open_gates(neurocache)
    a_ids, b_ids = torch.randint(0, VOCAB, (1, 8)), torch.randint(0, VOCAB, (1, 8))
    cache_a, cache_b = filled_cache(neurocache, seed=5), filled_cache(neurocache, seed=6)

    def run(binding, ids, past=None):
        with torch.no_grad(), neurocache.active(binding):
            return model(ids, past_key_values=past, use_cache=True)

    solo = CacheBinding([cache_a])
    out = run(solo, a_ids)
    expected = run(solo, a_ids[:, :1], out.past_key_values).logits
    binding_a, binding_b = CacheBinding([cache_a]), CacheBinding([cache_b])
    out_a = run(binding_a, a_ids)
    run(binding_b, b_ids)  # another request's step in between
    got = run(binding_a, a_ids[:, :1], out_a.past_key_values).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_recording_binding_keeps_each_pass_states_and_leaves_the_cache_alone():
    """What a remembered turn writes: C of the prompt pass, then of each decoding step, equal to
    compressing the whole sequence at once (layer r sits below every cache-attention layer)."""
    from engine.memories.neurocache.adapter import CacheBinding

    model, neurocache, _ = adapted("llama")
    open_gates(neurocache)
    ids = torch.randint(0, VOCAB, (1, 10))
    cache = filled_cache(neurocache)
    before = cache.states.clone()
    binding = CacheBinding([cache], record=[])
    with torch.no_grad():
        with neurocache.active(binding):
            past = model(ids[:, :7], use_cache=True).past_key_values
        for i in range(7, 10):
            with neurocache.active(binding):
                past = model(ids[:, i : i + 1], past_key_values=past, use_cache=True).past_key_values
    assert binding.record is not None
    assert [tuple(c.shape) for c in binding.record] == [(1, 7, neurocache.compressed_dim)] + [
        (1, 1, neurocache.compressed_dim)
    ] * 3
    torch.testing.assert_close(torch.cat(binding.record, dim=1), neurocache.compress(ids), rtol=1e-4, atol=1e-5)
    assert torch.equal(cache.states, before) and cache.size == 100


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_compress_equals_the_states_of_a_full_forward(arch):
    model, neurocache, _ = adapted(arch)
    open_gates(neurocache)
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad(), neurocache.attached([filled_cache(neurocache)]) as shared:
        model(ids)
        full = shared.compressed
    assert torch.equal(neurocache.compress(ids), full)
    assert neurocache.shared.caches is None  # the model is the base model again


def test_training_reencodes_retrieved_states_so_the_projection_learns():
    model, neurocache, _ = adapted("llama")
    open_gates(neurocache)
    cache = new_training_cache(neurocache, 256)
    first, second = torch.randint(0, VOCAB, (1, 16)), torch.randint(0, VOCAB, (1, 16))
    with training_caches(neurocache, [cache]) as shared:
        model(first)
        assert shared.compressed is not None and shared.hidden is not None
        cache.add(shared.compressed[0], document=0, values=shared.hidden[0])
    with training_caches(neurocache, [cache]) as shared:
        loss = model(second).logits.square().mean()
        assert shared.states is not None
        reencoded = shared.states.detach().clone()
    with torch.no_grad(), neurocache.attached([cache]) as shared:
        model(second)
        stored = shared.states
    # re-projecting the kept hidden states gives the stored compressed states (same W_p)
    assert stored.abs().sum() > 0
    torch.testing.assert_close(reencoded, stored, rtol=1e-5, atol=1e-5)
    loss.backward()
    assert neurocache.projection.proj.weight.grad is not None
    assert neurocache.projection.proj.weight.grad.abs().sum() > 0
    gates = [a.gate.grad for a in neurocache.cache_attention.values()]
    assert all(g is not None and g.abs().sum() > 0 for g in gates)


def test_serving_cache_stores_states_in_the_model_dtype():
    """A bfloat16 model's states are bfloat16 numbers: its cache keeps them at 2 bytes each, losslessly."""
    model = tiny("llama").to(torch.bfloat16)
    neurocache = Neurocache(model, CONFIG)
    cache = neurocache.new_cache(capacity=64)
    ids = torch.randint(0, VOCAB, (1, 20))
    compressed = neurocache.compress(ids)[0]
    cache.add(compressed, document=0)
    assert cache.dtype == torch.bfloat16 and cache.capacity == 64
    assert torch.equal(cache.states[:20], compressed)
    assert cache.nbytes == 64 * neurocache.compressed_dim * 2 + 2 * 64 * 8


def test_a_lora_layer_is_wrapped_for_the_batched_step():
    """The batched step reaches an adapter's LoRA layer through `Wrapped` (no import of it): it must match."""
    from torch import nn

    from engine.memories.neurocache.adapter import LoRALinear, RetrievalState
    from engine.models.llama_step import Wrapped, _plain

    base = nn.Linear(8, 8)
    lora = LoRALinear(base, rank=2, alpha=4.0, shared=RetrievalState())
    assert isinstance(lora, Wrapped) and _plain(lora) is base and _plain(base) is base
