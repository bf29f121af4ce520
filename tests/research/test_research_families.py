"""Segment-cache, Perceiver AR (baseline, V1, V2, V3) and LLP: exact causality by perturbation at
every boundary, the batched code against slow references, batch rows, gradients, the cases where
each reduces to the plain transformer, and the segment-cache stream against the one-pass forward."""

from __future__ import annotations

import pytest
import torch

from research.lms import build
from research.lms.segment_cache import select
from research.lms.segment_cache_stream import SegmentCacheStream
from tests.helpers import SMALL
from tests.research import reference_families as ref

T = 29  # not a multiple of any segment, half segment or latent below
FAMILIES: dict[str, tuple[str, dict]] = {
    "segment-cache": ("segment-cache", {"segment_len": 4, "memory_len": 4, "cache_segments": 3, "cache_top_k": 2}),
    "segment-cache-m8-k1": ("segment-cache", {"segment_len": 3, "memory_len": 6, "cache_segments": 2, "cache_top_k": 1}),
    "perceiver-ar": ("perceiver-ar", {"latent": 8}),
    "perceiver-ar-v1": ("perceiver-ar-v1", {"latent": 8}),
    "perceiver-ar-v2": ("perceiver-ar-v2", {"latent": 8, "history_segment": 5}),
    "perceiver-ar-v3": ("perceiver-ar-v3", {"latent": 8, "history_compressed": 3}),
    "llp": ("llp", {"segment_len": 6}),
}


def model_for(name: str, seed: int = 0, **overrides):
    arch, flags = FAMILIES[name]
    torch.manual_seed(seed)
    return build(arch, **{**SMALL, **flags, **overrides}).eval()


def boundaries(model) -> set[int]:
    """Positions where a rule changes: segment, half segment, memory, latent/history split, T-1."""
    cfg = model.config
    h = T - min(cfg.latent, T) if model.arch.startswith("perceiver") else None
    points = {0, T - 1}
    if model.arch == "segment-cache":
        l, m = cfg.segment_len, cfg.memory_len
        points |= {l - 1, l, m - 1, m, m + l - 1, m + l, 2 * m + l}
    if model.arch == "llp":
        half = cfg.segment_len // 2
        points |= {half - 1, half, cfg.segment_len - 1, cfg.segment_len}
    if h is not None:
        points |= {h - 1, h, h + 1, cfg.history_segment - 1, cfg.history_segment}
    return {p for p in points if 0 <= p < T}


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_changing_token_t_never_moves_earlier_outputs(name, seed):
    model = model_for(name, seed)
    generator = torch.Generator(torch.get_default_device()).manual_seed(seed)
    ids = torch.randint(0, 50, (2, T), generator=generator)
    with torch.no_grad():
        base = model(ids)
        first = T - base.shape[1]  # the position of the first output
        for t in sorted(boundaries(model)):
            changed = ids.clone()
            changed[:, t] = (ids[:, t] + 7) % 50
            out = model(changed)
            before = max(0, t - first)
            torch.testing.assert_close(out[:, :before], base[:, :before], rtol=0, atol=1e-5, msg=f"position {t} leaked")
            assert (out[:, before:] - base[:, before:]).abs().max() > 0  # the change itself is seen


@pytest.mark.parametrize("name", ["llp"])
def test_llp_attention_equals_slow_reference(name):
    model = model_for(name)
    x = torch.randn(2, 19, model.config.dim)
    attention = model.blocks[0].attn
    with torch.no_grad():
        torch.testing.assert_close(attention(x), ref.llp_attention(attention, x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", [n for n in FAMILIES if n.startswith("perceiver")])
@pytest.mark.parametrize("n_context", [0, 11])
def test_perceiver_attention_equals_slow_reference(name, n_context):
    model = model_for(name)
    attention = model.blocks[0].attn
    context, latent = torch.randn(2, n_context, model.config.dim), torch.randn(2, 7, model.config.dim)
    context_at, latent_at = torch.arange(n_context) * 2, torch.arange(n_context, n_context + 7) * 2  # any positions
    with torch.no_grad():
        got = attention(context, latent, context_at, latent_at)
        want = ref.perceiver_attention(attention, context, latent, context_at, latent_at)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
    if want[0] is None:
        assert got[0] is None
    else:
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", [n for n in FAMILIES if n.startswith("perceiver")])
def test_perceiver_model_equals_slow_reference(name):
    model = model_for(name)
    ids = torch.randint(0, 50, (2, T))  # a history of 21 positions, a latent of 8
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref.perceiver_forward(model, ids), rtol=1e-4, atol=1e-5)


def reference_segment_cache(model, ids):
    """The whole segment-cache forward from the slow pieces: query pass, picks, cached pass."""

    def run(picks):
        x = model.embed(ids)
        for block in model.blocks:
            x = x + ref.segment_cache_attention(block.attn, block.attn_norm(x), picks)
            x = x + block.mlp(block.mlp_norm(x))
        return model.norm(x)

    return run(ref.segment_picks(run(None), model.config)) @ model.embed.weight.T


@pytest.mark.parametrize("name", ["segment-cache", "segment-cache-m8-k1"])
@pytest.mark.parametrize("path", ["window", "gather"])
def test_segment_cache_equals_slow_reference(name, path):
    model = model_for(name).use_cache_path(path)
    ids = torch.randint(0, 50, (2, T))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference_segment_cache(model, ids), rtol=1e-4, atol=1e-5)


def test_selection_picks_only_cached_segments_by_weight():
    model = model_for("segment-cache")
    cfg = model.config
    l, M, N = cfg.segment_len, cfg.memory_len // cfg.segment_len, cfg.cache_segments
    queries = torch.randn(1, T, cfg.dim)
    picks = select(queries, queries[:, l - 1 :: l][:, : T // l], 0, torch.arange(T), cfg)
    want = ref.segment_picks(queries, cfg)[0]
    for t in range(T):
        got = [
            (int(s), float(w)) for s, w, ok in zip(picks.index[0, t], picks.weight[0, t], picks.valid[0, t], strict=True) if ok
        ]
        assert [s for s, _ in got] == [s for s, _ in want[t]], f"row {t}"
        assert all(t // l - M - N <= s < t // l - M for s, _ in got)  # in the cache, never the memory or later
        torch.testing.assert_close(torch.tensor([w for _, w in got]), torch.tensor([float(w) for _, w in want[t]]))
    assert picks.valid[0, (M + 1) * l :, 0].all() and not picks.valid[0, : (M + 1) * l].any()  # from segment M+1 on


@pytest.mark.parametrize("name", list(FAMILIES))
def test_batch_rows_are_independent(name):
    model = model_for(name)
    ids = torch.randint(0, 50, (3, T))
    with torch.no_grad():
        full = model(ids)
        torch.testing.assert_close(model(ids[1:2]), full[1:2], rtol=0, atol=1e-5)
        other = ids.clone()
        other[0] = torch.randint(0, 50, (T,))
        torch.testing.assert_close(model(other)[1:], full[1:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["segment-cache", "segment-cache-m8-k1", "llp"])
def test_a_shorter_input_gives_the_same_outputs(name):
    model = model_for(name)
    ids = torch.randint(0, 50, (2, T))
    with torch.no_grad():
        full = model(ids)
        for length in (1, 5, 13, 17):
            torch.testing.assert_close(model(ids[:, :length]), full[:, :length], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_gradients_reach_every_parameter(name):
    model = model_for(name).train()
    ids = torch.randint(0, 50, (2, T))
    model(ids).logsumexp(-1).sum().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{pname} gets no gradient"


def test_the_selection_weights_carry_gradient():
    """α scales the picked values, so the loss reaches the queries through the selection too."""
    model = model_for("segment-cache").train()
    l = model.config.segment_len
    x = model.embed(torch.randint(0, 50, (2, T)))
    queries = model.run(x, None).detach().requires_grad_()
    picks = select(queries, queries[:, l - 1 : (T // l) * l : l], 0, torch.arange(T), model.config)
    model.run(x, picks).sum().backward()
    assert queries.grad is not None and queries.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("llp", {"segment_len": 2 * T}),  # one half segment: plain causal attention
        ("perceiver-ar", {"latent": T}),  # all latent: no history
        ("perceiver-ar-v1", {"latent": T}),
        ("perceiver-ar-v2", {"latent": T}),
        ("segment-cache", {"memory_len": 32}),  # the memory reaches back to position 0: nothing is cached
    ],
)
def test_reduces_to_the_plain_transformer(name, overrides):
    model = model_for(name, **overrides)
    plain = build("transformer", **SMALL).eval()
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all(k.split(".")[-2].startswith("history") for k in unexpected)
    ids = torch.randint(0, 50, (2, T))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), plain(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["segment-cache", "segment-cache-m8-k1"])
@pytest.mark.parametrize("chunks", [[T], [1] * T, [3, 7, 2, 9, 8], [5] * 6])
def test_segment_cache_stream_equals_one_pass(name, chunks):
    model = model_for(name)
    ids = torch.randint(0, 50, (T,))
    with torch.no_grad():
        full = model(ids[None])[0]
    stream, outs, at = SegmentCacheStream(model), [], 0
    for n in chunks:
        outs.append(stream.feed(ids[at : at + n]))
        at += n
    torch.testing.assert_close(torch.cat(outs)[: len(full)], full, rtol=1e-4, atol=1e-5)


def test_segment_cache_stream_state_is_bounded_past_the_training_length():
    model = model_for("segment-cache")
    cfg = model.config
    stream = SegmentCacheStream(model)
    sizes = []
    for _ in range(6):
        logits = stream.feed(torch.randint(0, 50, (cfg.max_seq_len,)))
        assert logits.isfinite().all()
        sizes.append(stream.nbytes)
    assert stream.length == 6 * cfg.max_seq_len
    assert len(set(sizes)) == 1  # M + N segments per layer, whatever the length fed


@pytest.mark.parametrize(
    ("arch", "flags", "message"),
    [
        ("llp", {"segment_len": 5}, "even segment_len"),
        ("segment-cache", {"segment_len": 4, "memory_len": 6, "cache_top_k": 1}, "multiple of segment_len"),
        ("segment-cache", {"cache_top_k": 0}, "cache_top_k"),
        ("segment-cache", {"cache_top_k": 9, "cache_segments": 8}, "cache_top_k"),
        ("perceiver-ar-v3", {"latent": 64}, "max_seq_len > latent"),
        ("perceiver-ar-v9", {}, "unknown arch"),
    ],
)
def test_build_refuses_bad_requests(arch, flags, message):
    with pytest.raises(ValueError, match=message):
        build(arch, **{**SMALL, **flags})
    with pytest.raises(ValueError, match="unknown cache path"):
        model_for("segment-cache").use_cache_path("dense")
