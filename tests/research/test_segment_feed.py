"""Streaming the Long-Short and CacheFormer LMs chunk by chunk equals one forward pass; rollback
forgets exactly what was fed after the mark."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from research.lms import build
from research.lms.segment_feed import FeedState, feed

SMALL = dict(vocab_size=50, dim=16, n_layers=2, n_heads=2, max_seq_len=128, window=6, segment_len=4, compressed_per_segment=2)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "long-short": ("long-short", {}),
    "cf-overlap": ("cacheformer", {"overlap": True}),
    "cf-cache-p4": ("cacheformer", {"cache_top_k": 2, "group_size": 4}),
    "cf-cache-p1-u3": ("cacheformer", {"cache_top_k": 2, "group_size": 1, "cache_neighbours": 3}),
    "cf-both-p8": ("cacheformer", {"overlap": True, "cache_top_k": 3, "group_size": 8, "cache_neighbours": 3}),
}
CHUNKINGS = {"one-by-one": [1] * 70, "ragged": [3, 1, 7, 16, 2, 9, 5, 27], "whole": [70]}


def model_for(name: str, seed: int = 0):
    arch, flags = VARIANTS[name]
    torch.manual_seed(seed)
    return build(arch, **{**SMALL, **flags}).eval()


def fed(model, ids: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    state, out, at = FeedState(model), [], 0
    for size in sizes:
        out.append(feed(model, state, ids[at : at + size]))
        at += size
    assert at == len(ids) and state.length == len(ids)
    return torch.cat(out)


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("chunking", list(CHUNKINGS))
def test_feeding_in_chunks_equals_one_pass(name, chunking):
    model = model_for(name)
    ids = torch.randint(0, 50, (70,), generator=torch.Generator(torch.get_default_device()).manual_seed(1))
    with torch.no_grad():
        full = model(ids[None])[0]
    torch.testing.assert_close(fed(model, ids, CHUNKINGS[chunking]), full, rtol=1e-4, atol=1e-4)


def test_feeding_goes_past_the_training_length():
    model = model_for("cf-both-p8")
    ids = torch.randint(0, 50, (300,), generator=torch.Generator(torch.get_default_device()).manual_seed(2))  # max_seq_len is 128
    with pytest.raises(ValueError, match="at most 128"):
        model(ids[None])
    logits = fed(model, ids, [100, 100, 100])
    assert logits.shape == (300, 50) and torch.isfinite(logits).all()
    torch.testing.assert_close(logits[:128], model(ids[None, :128])[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["long-short", "cf-both-p8"])
def test_rollback_forgets_what_was_fed_after_the_mark(name):
    model = model_for(name)
    gen = torch.Generator(torch.get_default_device()).manual_seed(3)
    prefix, detour, suffix = (torch.randint(0, 50, (n,), generator=gen) for n in (37, 23, 11))
    state = FeedState(model)
    feed(model, state, prefix)
    mark, saved = state.mark(), state.state_dict()
    feed(model, state, detour)
    assert state.length == 60
    state.rollback(mark)
    assert state.length == 37 and state.state_dict().keys() == saved.keys()
    assert all(torch.equal(state.state_dict()[k], saved[k]) for k in saved)  # held rows: exactly those of the mark
    after = feed(model, state, suffix)
    expected = model(torch.cat([prefix, suffix])[None])[0, 37:]
    torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-4)


def test_a_plain_transformer_is_refused():
    model = build("transformer", **SMALL)
    with pytest.raises(ValueError, match="only long-short and cacheformer"):
        feed(model, FeedState(model), [1, 2])


def test_saved_state_restores_to_the_same_continuation():
    model = model_for("cf-both-p8")
    gen = torch.Generator(torch.get_default_device()).manual_seed(4)
    prefix, suffix = torch.randint(0, 50, (45,), generator=gen), torch.randint(0, 50, (9,), generator=gen)
    state = FeedState(model)
    feed(model, state, prefix)
    restored = FeedState(model)
    restored.load_state_dict(state.state_dict())
    assert restored.length == 45 and restored.nbytes == state.nbytes
    torch.testing.assert_close(feed(model, restored, suffix), feed(model, state, suffix), rtol=0, atol=0)
