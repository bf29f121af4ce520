"""Transformer, Long-Short and CacheFormer: exact causality by perturbation, the batched attention
against a slow reference, padding, and batch-row independence."""

from __future__ import annotations

import pytest
import torch

from research.lms import build
from tests.helpers import SMALL, VARIANTS
from tests.research.reference_attention import reference_forward

T = 29  # not a multiple of l, w or p


def model_for(name: str, seed: int = 0):
    arch, flags = VARIANTS[name]
    torch.manual_seed(seed)
    return build(arch, **{**SMALL, **flags}).eval()


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_changing_token_t_never_moves_earlier_outputs(name, seed):
    model = model_for(name, seed)
    cfg = model.config
    generator = torch.Generator(torch.get_default_device()).manual_seed(seed)
    ids = torch.randint(0, 50, (2, T), generator=generator)
    with torch.no_grad():
        base = model(ids)
        checked = {0, cfg.segment_len - 1, cfg.segment_len, cfg.window - 1, cfg.window, cfg.group_size - 1, cfg.group_size, T - 1}
        for t in sorted(p for p in checked if p < T):
            changed = ids.clone()
            changed[:, t] = (ids[:, t] + 7) % 50
            out = model(changed)
            torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-5, msg=f"position {t} leaked")
            assert (out[:, t] - base[:, t]).abs().max() > 0  # the change itself is seen


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "transformer"])
def test_batched_attention_equals_slow_reference(name):
    model = model_for(name)
    x = torch.randn(2, 19, model.config.dim)
    attention = model.blocks[0].attn
    with torch.no_grad():
        torch.testing.assert_close(attention(x), reference_forward(attention, x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_padding_and_batch_rows_do_not_change_real_outputs(name):
    model = model_for(name)
    ids = torch.randint(0, 50, (3, T))
    with torch.no_grad():
        full = model(ids)
        for length in (1, 5, 13, 17):
            torch.testing.assert_close(model(ids[:, :length]), full[:, :length], rtol=0, atol=1e-5)
        torch.testing.assert_close(model(ids[1:2]), full[1:2], rtol=0, atol=1e-5)
        other = ids.clone()
        other[0] = torch.randint(0, 50, (T,))
        torch.testing.assert_close(model(other)[1:], full[1:], rtol=0, atol=1e-5)


def test_selection_never_picks_a_segment_ending_inside_or_after_the_group():
    from research.lms.segments import segment_ends, select_segments

    S, p = 8, 4
    ends = segment_ends(S, 4, 0, torch.get_default_device())  # 3, 7, 11, ...
    scores = torch.rand(1, 1, 8, S) + 1.0  # even if later segments score highest
    scores[..., -3:] = 100.0
    for u in (1, 2, 3):
        indices, valid = select_segments(scores, ends, torch.arange(8) * p, top_k=3, neighbours=u)
        for g in range(8):
            picked = indices[0, 0, g][valid[0, 0, g]].tolist()
            assert all(int(ends[s]) < g * p for s in picked), (g, picked)
            assert len(picked) == len(set(picked))


def test_build_refuses_bad_requests():
    with pytest.raises(ValueError, match="unknown arch"):
        build("nope")
    with pytest.raises(ValueError, match="cacheformer"):
        build("long-short", overlap=True)
    with pytest.raises(ValueError, match="at most"):
        model_for("transformer")(torch.zeros(1, 65, dtype=torch.long))


def test_all_variants_have_equal_width():
    counts = {name: model_for(name).num_parameters() for name in VARIANTS}
    assert len({c for n, c in counts.items() if n.startswith("cf-cache") or n == "long-short"}) == 1
    assert max(counts.values()) / min(counts.values()) < 1.05  # overlap adds only a small projection


def test_gradients_flow_through_every_parameter():
    model = model_for("cf-both-p8").train()
    loss = model(torch.randint(0, 50, (2, T))).logsumexp(-1).mean()
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, missing


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # unfused on purpose
@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "transformer"])
@pytest.mark.parametrize("length", [3, T, 64])
def test_flex_kernel_equals_plain_tensor_path(name, length):
    """The fused path (blocks merged by log-sum-exp) computes the same softmax; on CPU flex runs
    unfused, so this checks its arithmetic; CUDA compiles the same code into one kernel."""
    model = model_for(name)
    ids = torch.randint(0, 50, (2, length), generator=torch.Generator(torch.get_default_device()).manual_seed(5))
    with torch.inference_mode():
        plain = model.use_kernel("math")(ids)
        fused = model.use_kernel("flex")(ids)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


def test_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="kernel"):
        model_for("long-short").use_kernel("triton")


def test_compiled_flex_kernel_equals_plain_tensor_path():
    """The same path compiled by torch.compile into fused CPU kernels (inference only on CPU)."""
    from research.lms import flex

    model = model_for("cf-both-p8")
    ids = torch.randint(0, 50, (2, 64), generator=torch.Generator(torch.get_default_device()).manual_seed(5))
    flex.compile_kernels()
    try:
        with torch.inference_mode():
            plain = model.use_kernel("math")(ids)
            fused = model.use_kernel("flex")(ids)
    finally:
        flex.compile_kernels(False)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
