"""Segment-selection attention over a model's own keys/values: equal to the plain model where it holds
everything, causal while feeding, never selecting the current or a future segment, exact on restore."""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from typing import Any, cast

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from engine.memories.kvcache import select as kv_select
from engine.memories.kvcache import store as kv_store
from engine.memories.kvcache.select import SelectConfig, SelectiveAnswer, SelectiveModel, pick_segments
from engine.memories.kvcache.store import KVStore
from engine.models.rope import apply_rope as rotate

VOCAB = 97


def tiny_model(family: str = "llama", seed: int = 0):
    torch.manual_seed(seed)
    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    return LlamaForCausalLM(LlamaConfig(**common)).eval()


def fed(
    model, config: SelectConfig, ids: list[int], chunk: int, storage: str = "float32"
) -> tuple[SelectiveModel, KVStore, torch.Tensor]:
    selective = SelectiveModel(model, config)
    store = KVStore(selective.store_shape(storage), device=torch.get_default_device(), dtype=selective.dtype)
    store.reserve(len(ids))
    logits = [cast(torch.Tensor, selective.feed(store, ids[i : i + chunk], logits=True)) for i in range(0, len(ids), chunk)]
    return selective, store, torch.cat(logits)


def plain_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def answer_logits(selective: SelectiveModel, store: KVStore, prompt: list[int], steps: list[int]) -> list[torch.Tensor]:
    answer = SelectiveAnswer(selective, store, len(prompt) + len(steps))
    out = [answer.forward(prompt)]
    out += [answer.forward([token]) for token in steps]
    return out


def random_ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator(torch.get_default_device()).manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_text_within_sinks_and_window_equals_plain_model(family):
    model = tiny_model(family)
    config = SelectConfig(segment_len=8, top_k=2, neighbours=1, window=96, sinks=8, query_chunk=8)
    ids = random_ids(90)
    selective, store, logits = fed(model, config, ids[:80], chunk=24)
    full = plain_logits(model, ids)
    torch.testing.assert_close(logits, full[:80], atol=1e-4, rtol=0)
    out = answer_logits(selective, store, ids[80:86], ids[86:90])
    for j, position in enumerate([85, 86, 87, 88, 89]):
        torch.testing.assert_close(out[j], full[position], atol=1e-4, rtol=0)


@pytest.mark.parametrize("selection", ["summary", "keys"])
def test_top_k_covering_every_segment_equals_full_attention(selection):
    model = tiny_model()
    config = SelectConfig(segment_len=8, top_k=64, neighbours=1, window=16, sinks=4, query_chunk=5, selection=selection)
    ids = random_ids(200)
    selective, store, logits = fed(model, config, ids[:180], chunk=20)
    assert selective.eligible(store, 180) > 10  # the window alone does not hold the text
    full = plain_logits(model, ids)
    torch.testing.assert_close(logits, full[:180], atol=1e-4, rtol=0)
    out = answer_logits(selective, store, ids[180:192], ids[192:200])
    for j, position in enumerate(range(191, 200)):
        torch.testing.assert_close(out[j], full[position], atol=1e-4, rtol=0)


def test_small_top_k_differs_from_full_attention():
    """The check above can fail: with fewer segments than the text has, logits do change."""
    model = tiny_model()
    config = SelectConfig(segment_len=8, top_k=1, neighbours=1, window=16, sinks=4)
    ids = random_ids(180)
    _, _, logits = fed(model, config, ids, chunk=20)
    assert (logits[-20:] - plain_logits(model, ids)[-20:]).abs().max() > 1e-3


@pytest.mark.parametrize("summary", ["mean", "representative"])
def test_feeding_is_causal(summary):
    """Changing token t changes no logit, and no stored key or value, before t."""
    model = tiny_model()
    config = SelectConfig(segment_len=8, top_k=2, neighbours=3, window=16, sinks=4, summary=summary, representatives=2)
    ids = random_ids(240)
    t = 170
    changed = list(ids)
    changed[t] = (ids[t] + 1) % VOCAB
    _, store_a, logits_a = fed(model, config, ids, chunk=20)
    _, store_b, logits_b = fed(model, config, changed, chunk=20)
    assert torch.equal(logits_a[:t], logits_b[:t])
    assert not torch.equal(logits_a[t:], logits_b[t:])
    before = (t - config.sinks) // config.segment_len  # segments wholly before t
    for layer in range(2):
        a, b = store_a.segment_rows(layer, list(range(before))), store_b.segment_rows(layer, list(range(before)))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_selection_never_returns_current_or_future_segments():
    scores = torch.tensor([[1.0, 2.0, 3.0, 100.0, 200.0], [5.0, 0.0, 0.0, 50.0, 60.0]])
    picks = pick_segments(scores, eligible=3, top_k=2, neighbours=3)
    assert all(s < 3 for p in picks for s in p)
    assert picks == [[0, 1, 2], [0, 1, 2]]
    assert pick_segments(scores, eligible=0, top_k=2, neighbours=3) == [[], []]
    assert pick_segments(scores, eligible=5, top_k=1, neighbours=1) == [[4], [4]]
    # overlapping neighbours leave room: the next best segments fill it, so every head holds k·u
    assert pick_segments(torch.tensor([[9.0, 8.0, 7.0, 0.0, 1.0, 0.0]]), eligible=6, top_k=2, neighbours=2) == [[0, 1, 2, 4]]


def test_max_pooled_queries_pick_the_segment_one_row_points_at():
    """query_pool "max": a segment one query row points at wins where the rows' mean points elsewhere."""
    selective = SelectiveModel(tiny_model(), SelectConfig(query_pool="max"))  # 2 kv heads, 2 query heads each, D 8
    D = selective.head_dim
    summaries = torch.zeros(3, 1, 2, D)  # S, R, Hkv, D: unit rows along axes 0, 1, 2
    for s in range(3):
        summaries[s, 0, :, s] = 1.0
    q = torch.zeros(4, 5, D)  # Hq, T, D: every row near axis 0 (cosine 0.89), one row of each head's group on axis 2
    q[:, :, 0], q[:, :, 1] = 1.0, 0.5
    q[:, 2] = 0.0
    q[:, 2, 2] = 0.3  # short, but pointing exactly at segment 2
    assert selective.answer_scores(summaries, q).argmax(dim=-1).tolist() == [2, 2]
    mean = SelectiveModel(tiny_model(), SelectConfig(query_pool="mean"))
    assert mean.answer_scores(summaries, q).argmax(dim=-1).tolist() == [0, 0]


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8"])
def test_head_segments_are_each_heads_picks_of_segment_rows(storage):
    config = SelectConfig(segment_len=8, top_k=2, neighbours=1, window=16, sinks=4)
    selective, store, _ = fed(tiny_model(), config, random_ids(120), chunk=24, storage=storage)
    picks = [[0, 3, 9], [2, 3, 5]]  # per key/value head, in the order given
    keys, values = store.head_segments(1, picks)
    rows_k, rows_v = store.segment_rows(1, list(range(10)))  # n, l, H, D
    for h, segments in enumerate(picks):
        torch.testing.assert_close(keys[h], rows_k[segments, :, h].flatten(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(values[h], rows_v[segments, :, h].flatten(0, 1), rtol=0, atol=0)


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8"])
def test_best_key_logits_are_each_segments_best_dot_product_across_pages(storage, monkeypatch):
    monkeypatch.setattr(kv_store, "PAGE_TOKENS", 32)  # 4 segments a page: 10 segments end inside the third
    config = SelectConfig(segment_len=8, top_k=2, neighbours=1, window=16, sinks=4)
    _, store, _ = fed(tiny_model(), config, random_ids(120), chunk=24, storage=storage)
    rows_k, _ = store.segment_rows(1, list(range(10)))  # S, l, H, D as segment_rows widens them
    rows = torch.randn(2, 5, rows_k.shape[-1])  # H, R, D
    for segments in (10, 9, 4, 1):
        expected = torch.einsum("slhd,hrd->hslr", rows_k[:segments].float(), rows).flatten(2).amax(dim=-1)
        torch.testing.assert_close(store.best_key_logits(1, segments, rows), expected)


def test_key_scores_are_each_segments_best_logit_with_its_keys_placed_before_the_rows(monkeypatch):
    """The rows and keys rotated at their own positions (the rows at 500 + t, every key `distance`
    before the first row), as attention would see them; the best logit of each segment."""
    monkeypatch.setattr(kv_store, "PAGE_TOKENS", 24)  # 3 segments a page: the result must not depend on pages
    config = SelectConfig(segment_len=8, top_k=2, neighbours=1, window=16, sinks=4, selection="keys")
    selective, store, _ = fed(tiny_model(), config, random_ids(120), chunk=24, storage="float32")
    q = torch.randn(4, 5, selective.head_dim)  # Hq, T, D
    keys, _ = store.segment_rows(0, list(range(10)))  # S, l, Hkv, D
    distance, first_row = 37, 500
    q_rotated = rotate(q, *selective._rope(torch.arange(first_row, first_row + 5), torch.float32))
    k_rotated = rotate(keys, *selective._rope(torch.tensor([first_row - distance]), torch.float32))
    expected = torch.zeros(2, 10)
    for h in range(2):
        rows = q_rotated[2 * h : 2 * h + 2].reshape(-1, selective.head_dim)  # the head's query group, every row
        for s in range(10):
            expected[h, s] = (k_rotated[s, :, h] @ rows.T).max()
    torch.testing.assert_close(selective.key_scores(store, 0, 10, q, distance), expected)
    assert not torch.allclose(selective.key_scores(store, 0, 10, q, 0), expected)  # where the keys sit matters


@pytest.mark.parametrize("reselect_every", [8, 0])
def test_key_selection_places_the_keys_in_the_middle_of_the_selected_region(monkeypatch, reselect_every):
    """Every selection while answering (prompt chunks and reselecting decode steps) scores the keys
    as sitting in the middle of the selected region: `distance` from the first query row there.
    With reselect_every 0 the decode steps select nothing."""
    config = SelectConfig(
        segment_len=8, top_k=2, neighbours=1, window=16, sinks=4, query_chunk=4, selection="keys", reselect_every=reselect_every
    )
    selective, store, _ = fed(tiny_model(), config, random_ids(120), chunk=24)
    answer = SelectiveAnswer(selective, store, 10)
    seen: list[tuple[int, int]] = []  # (distance, the first row's position)
    real = selective.key_scores

    def spy(store, layer_index, eligible, q, distance):
        seen.append((distance, answer.length))
        return real(store, layer_index, eligible, q, distance)

    monkeypatch.setattr(selective, "key_scores", spy)
    prompt, steps = random_ids(8, seed=2), random_ids(2, seed=3)
    answer.forward(prompt)
    for token in steps:
        answer.forward([token])
    middle = (answer.sinks + answer.window_position) // 2
    layers = len(selective.layers)
    first_rows = [answer.length - 10, answer.length - 6] + ([answer.length - 2] if reselect_every else [])
    assert len(seen) == layers * len(first_rows)  # two prompt chunks, and with 8 the first decode step
    assert all(distance == first_row - middle for distance, first_row in seen)
    assert sorted({first_row for _, first_row in seen}) == first_rows


@pytest.mark.parametrize("storage", ["bfloat16", "int8"])
def test_compact_storage_stays_close(storage):
    model = tiny_model()
    config = SelectConfig(segment_len=8, top_k=64, neighbours=1, window=16, sinks=4)
    ids = random_ids(200)
    _, _, exact = fed(model, config, ids, chunk=20)
    _, _, compact = fed(model, config, ids, chunk=20, storage=storage)
    assert (compact - exact).abs().max() < 0.05


def test_rollback_and_restore_are_exact():
    model = tiny_model()
    config = SelectConfig(segment_len=8, top_k=2, neighbours=3, window=16, sinks=4)
    ids = random_ids(260)
    selective, store, _ = fed(model, config, ids[:200], chunk=20)
    saved = copy.deepcopy(store.state_dict())
    before = answer_logits(selective, store, ids[200:210], ids[210:214])
    mark = store.mark()
    store.reserve(60)
    selective.feed(store, ids[200:260])
    store.rollback(mark)
    after_rollback = answer_logits(selective, store, ids[200:210], ids[210:214])
    restored = KVStore(selective.store_shape("float32"), device=torch.get_default_device(), dtype=torch.float32)
    restored.load_state_dict(saved)
    after_restore = answer_logits(selective, restored, ids[200:210], ids[210:214])
    for a, b, c in zip(before, after_rollback, after_restore, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def same_state(a, b) -> bool:
    """Nested state dicts equal tensor by tensor, bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("storage", ["float32", "int8"])
def test_a_rolled_back_document_leaves_nothing_in_the_kept_page(storage):
    """The aborted document's rows in the last kept page are cleared, so the state (and a snapshot
    of it) is the one from before, bit for bit."""
    model = tiny_model()
    config = SelectConfig(segment_len=8, top_k=2, neighbours=3, window=16, sinks=4)
    ids = random_ids(300)
    selective, store, _ = fed(model, config, ids[:200], chunk=20, storage=storage)
    store.trim()
    saved = copy.deepcopy(store.state_dict())
    mark = store.mark()
    store.reserve(100)
    selective.feed(store, ids[200:300])
    assert not same_state(store.state_dict(), saved)
    store.rollback(mark)
    assert same_state(store.state_dict(), saved)


@pytest.mark.parametrize(("tokens", "sinks"), [(3000, 4), (3001, 4), (394, 10), (7, 10)])
def test_bytes_are_counted_before_they_are_allocated(tokens, sinks):
    model = tiny_model()
    config = SelectConfig(segment_len=8, top_k=2, neighbours=1, window=16, sinks=sinks)
    selective = SelectiveModel(model, config)
    store = KVStore(selective.store_shape("bfloat16"), device=torch.get_default_device(), dtype=torch.float32)
    for part in (random_ids(tokens, seed=1), random_ids(tokens, seed=2)):  # a first document, then a second
        bound = store.added_bytes(len(part))
        start = store.nbytes
        store.reserve(len(part))
        for i in range(0, len(part), 100):
            selective.feed(store, part[i : i + 100])
            assert store.nbytes - start <= bound
        if tokens >= 1000:  # the bound is close for a document of whole pages
            assert store.nbytes - start > 0.5 * bound


@pytest.mark.parametrize("selection", ["keys", "summary"])
def test_vote_attends_the_first_passes_most_picked_segments_in_every_layer(selection, monkeypatch):
    """With `vote` the prompt pass runs twice: the first counts, per segment, the (layer, head)
    pairs ranking it in their top-k; the second gives the same logits as an answer whose every
    layer and head scores the segments by those counts (nothing of the first pass is left)."""
    config = SelectConfig(segment_len=8, top_k=2, neighbours=1, window=16, sinks=4, query_chunk=4, selection=selection)
    selective, store, _ = fed(tiny_model(), config, random_ids(160), chunk=24)
    prompt = random_ids(10, seed=2)
    selective.config = dataclasses.replace(config, vote=True)
    voted = SelectiveAnswer(selective, store, 12)
    logits = voted.forward(prompt)
    votes = voted._votes
    pairs = len(selective.layers) * selective.kv_heads * 3  # three prompt chunks of the first pass
    assert int(votes.round().sum()) == pairs * config.top_k  # one vote per head's top-k pick, ties below one
    expected = pick_segments(votes[None], voted.eligible, config.top_k, config.neighbours)[0]
    assert voted.picked == Counter({s: len(selective.layers) for s in expected})

    selective.config = config
    scored_by_votes = SelectiveAnswer(selective, store, 12)
    monkeypatch.setattr(selective, "key_scores", lambda *args: votes.expand(selective.kv_heads, -1))
    monkeypatch.setattr(selective, "answer_scores", lambda *args: votes.expand(selective.kv_heads, -1))
    torch.testing.assert_close(scored_by_votes.forward(prompt), logits, rtol=0, atol=1e-5)


def test_given_picks_are_attended_in_every_layer_and_checked():
    """Picks chosen outside (selection "text") are what every layer and head attends: the same
    logits as any selection that picks them; a wrong count or an ineligible segment is refused."""
    config = SelectConfig(segment_len=8, top_k=2, neighbours=1, window=16, sinks=4, query_chunk=4, selection="text")
    selective, store, _ = fed(tiny_model(), config, random_ids(160), chunk=24)
    prompt, steps = random_ids(10, seed=2), random_ids(3, seed=3)
    given = SelectiveAnswer(selective, store, 14, picks=[3, 7])
    out = [given.forward(prompt)] + [given.forward([t]) for t in steps]
    assert given.picked == Counter({3: len(selective.layers), 7: len(selective.layers)})
    selective.config = dataclasses.replace(config, selection="keys", reselect_every=1)
    scores = torch.zeros(given.eligible)
    scores[[3, 7]] = 1.0
    keyed = SelectiveAnswer(selective, store, 14)
    keyed_scores = scores.expand(selective.kv_heads, -1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(selective, "key_scores", lambda *args: keyed_scores)
        expected = [keyed.forward(prompt)] + [keyed.forward([t]) for t in steps]
    torch.testing.assert_close(torch.stack(out), torch.stack(expected), rtol=0, atol=1e-5)
    for bad in ([3, 3], [3, given.eligible], [3, 5, 7]):
        with pytest.raises(ValueError, match="distinct segments"):
            SelectiveAnswer(selective, store, 14, picks=bad)


def test_fewer_given_picks_shorten_the_selected_region():
    """Fewer picks than the layout's k·u places (selection "text" with a margin): the window
    follows them, as in a layout with that many places; the same logits as selecting them so."""
    config = SelectConfig(segment_len=8, top_k=2, neighbours=1, window=16, sinks=4, query_chunk=4, selection="text")
    selective, store, _ = fed(tiny_model(), config, random_ids(160), chunk=24)
    prompt, steps = random_ids(10, seed=2), random_ids(3, seed=3)
    given = SelectiveAnswer(selective, store, 14, picks=[5])
    out = [given.forward(prompt)] + [given.forward([t]) for t in steps]
    assert given.window_position == config.sinks + config.segment_len
    selective.config = dataclasses.replace(config, top_k=1, selection="keys", reselect_every=1)
    scores = torch.zeros(given.eligible)
    scores[5] = 1.0
    keyed = SelectiveAnswer(selective, store, 14)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(selective, "key_scores", lambda *args: scores.expand(selective.kv_heads, -1))
        expected = [keyed.forward(prompt)] + [keyed.forward([t]) for t in steps]
    torch.testing.assert_close(torch.stack(out), torch.stack(expected), rtol=0, atol=1e-5)
    selective.config = config
    nothing = SelectiveAnswer(selective, store, 14, picks=[])
    assert nothing.window_position == config.sinks and nothing.forward(prompt).isfinite().all()


def test_reread_picks_hold_the_plain_models_keys_and_values_of_the_sinks_and_picks():
    """`reread`: the given picks' keys and values are computed again from their tokens after the
    sinks (each attending to the sinks and the picks before it), not read from the store: the
    buffer's first columns are the plain model's cache over sinks + picks' tokens, which the
    stored picks (written in their document context) are not."""
    config = SelectConfig(segment_len=8, top_k=2, neighbours=1, window=16, sinks=4, query_chunk=4, selection="text")
    ids = random_ids(160)
    selective, store, _ = fed(tiny_model(), config, ids, chunk=24)
    picks = [3, 7]
    tokens = [t for p in picks for t in ids[4 + p * 8 : 4 + (p + 1) * 8]]
    reread = SelectiveAnswer(selective, store, 14, picks=picks, pick_tokens=tokens)
    stored = SelectiveAnswer(selective, store, 14, picks=picks)
    prompt = random_ids(10, seed=2)
    for answer in (reread, stored):  # the prompt pass writes stored picks into the region, unless reread
        assert answer.forward(prompt).isfinite().all()
    with torch.no_grad():
        cache = selective.model(input_ids=torch.tensor([ids[:4] + tokens]), use_cache=True).past_key_values
    columns = 4 + len(tokens)
    for layer in range(len(selective.layers)):
        torch.testing.assert_close(reread.keys[layer, :, :columns], cache.layers[layer].keys[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(reread.values[layer, :, :columns], cache.layers[layer].values[0], rtol=0, atol=1e-5)
    assert not torch.allclose(stored.values[1, :, 4:columns], reread.values[1, :, 4:columns], atol=1e-3)
    assert reread.picked == Counter({3: len(selective.layers), 7: len(selective.layers)})
    with pytest.raises(ValueError, match="pick_tokens"):
        SelectiveAnswer(selective, store, 14, picks=picks, pick_tokens=tokens[:-1])


@pytest.mark.parametrize("reread_rows", [1024, 40])
def test_reread_with_every_segment_given_equals_full_attention(monkeypatch, reread_rows):
    """`reread` with every eligible segment given: the picks, run again after the sinks, are the
    text before the window, so the answer is the plain model's over the whole text, and it reads
    no stored pick: with the store's segments zeroed it still is, while the stored picks' answer
    moves. With all picks in one pass with the prompt's first chunk, or (40 rows a pass) in
    passes of picks before it, the last still with the prompt."""
    monkeypatch.setattr(kv_select, "REREAD_ROWS", reread_rows)
    model = tiny_model()
    config = SelectConfig(segment_len=8, top_k=64, neighbours=1, window=16, sinks=4, query_chunk=5, selection="text")
    ids = random_ids(200)
    selective, store, _ = fed(model, config, ids[:180], chunk=20)
    eligible = selective.eligible(store, 180)
    assert eligible > 10
    picks, full = list(range(eligible)), plain_logits(model, ids)
    real = store.head_segments
    monkeypatch.setattr(store, "head_segments", lambda *args: tuple(torch.zeros_like(t) for t in real(*args)))

    def answer(pick_tokens: list[int] | None) -> list[torch.Tensor]:
        run = SelectiveAnswer(selective, store, 20, picks=picks, pick_tokens=pick_tokens)
        return [run.forward(ids[180:192])] + [run.forward([t]) for t in ids[192:200]]

    reread = answer(ids[4 : 4 + eligible * 8])
    for j, position in enumerate(range(191, 200)):
        torch.testing.assert_close(reread[j], full[position], atol=1e-4, rtol=0)
    assert (answer(None)[0] - full[191]).abs().max() > 1e-3


def test_reread_with_a_bfloat16_model_and_float32_buffers_matches_float32():
    """The served case: a bf16 model whose answer buffers are float32 (what the C step reads).
    `reread` writes its rows by column index, which casts nothing itself: the answer is the
    float32 model's within bf16's precision (about 1e-3 here), closer than the stored picks'
    answer is (about 1e-2)."""
    config = SelectConfig(segment_len=8, top_k=2, neighbours=1, window=16, sinks=4, query_chunk=4, selection="text")
    ids, picks = random_ids(160), [3, 7]
    tokens = [t for p in picks for t in ids[4 + p * 8 : 4 + (p + 1) * 8]]
    prompt = random_ids(10, seed=2)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        selective, store, _ = fed(tiny_model().to(dtype), config, ids, chunk=24)
        selective.answer_dtype = torch.float32
        answer = SelectiveAnswer(selective, store, 14, picks=picks, pick_tokens=tokens)
        out[dtype] = answer.forward(prompt).float()
    stored = SelectiveAnswer(selective, store, 14, picks=picks).forward(prompt).float()
    torch.testing.assert_close(out[torch.bfloat16], out[torch.float32], rtol=0, atol=5e-3)
    assert (stored - out[torch.float32]).abs().max() > 5e-3
