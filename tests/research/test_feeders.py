"""The feeders the `state` memory runs each from-scratch family with (research/lms/feeders.py): what
a feed returns against the model run directly, undo by mark and rollback, save and restore, and the
byte bounds the memory counts against the session budget before feeding."""

from __future__ import annotations

import pytest
import torch

from research.lms import ARCHS, build
from research.lms.feeders import SegmentFeed, WindowFeed, feeder_for
from research.lms.lm_io import save_checkpoint
from tests.helpers import FIXTURES, SMALL, VARIANTS, greedy
from tests.research.test_research_families import FAMILIES as NEW_FAMILIES
from tests.research.test_research_families import model_for

TEXT = (FIXTURES / "alice29.txt").read_text(encoding="utf-8")[:3000]  # longer than each served model's window
FAMILIES = {**NEW_FAMILIES, **{name: VARIANTS[name] for name in ("transformer", "long-short", "cf-both-p8")}}


def model_of(name: str):
    if name in NEW_FAMILIES:
        return model_for(name)
    arch, flags = FAMILIES[name]
    torch.manual_seed(0)
    return build(arch, **{**SMALL, **flags}).eval()


def fed(feeder, ids: torch.Tensor, chunks: list[int]) -> list[torch.Tensor]:
    """The logits after each chunk."""
    out, at = [], 0
    for n in chunks:
        out.append(feeder.feed(ids[at : at + n].tolist()))
        at += n
    return out


def test_every_family_has_a_feeder():
    models = [build(arch, **{**SMALL, **flags}) for arch, flags in FAMILIES.values()]
    assert {model.arch for model in models} == set(ARCHS)
    for model in models:
        feeder_for(model).feed([1, 2, 3])
    model = models[0]
    model.arch = "unknown-family"
    with pytest.raises(ValueError, match="no feeder"):
        feeder_for(model)


@pytest.mark.parametrize("name", ["transformer", "llp", "segment-cache", "long-short", "cf-both-p8"])
def test_for_a_causal_family_each_feed_equals_one_forward_over_everything(name):
    """Where each output sees only the tokens before it, one forward over the whole input gives
    every feed's answer at once: an independent check of what each feed returns."""
    model = model_of(name)
    ids = torch.randint(0, 50, (SMALL["max_seq_len"],))
    chunks = [1, 6, 20, 13, 24]
    with torch.no_grad():
        full = model(ids[None])[0]
    ends = torch.tensor(chunks).cumsum(0) - 1
    torch.testing.assert_close(torch.stack(fed(feeder_for(model), ids, chunks)), full[ends], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_within_the_window_each_feed_equals_the_model_run_directly(name):
    """Inside max_seq_len every family's feed gives the logits the one-pass forward gives there."""
    model = model_of(name)
    ids = torch.randint(0, 50, (SMALL["max_seq_len"],))
    chunks = [5, 1, 17, 9, 32]
    got = fed(feeder_for(model), ids, chunks)
    with torch.no_grad():
        for logits, end in zip(got, torch.tensor(chunks).cumsum(0).tolist(), strict=True):
            torch.testing.assert_close(logits, model(ids[None, :end])[0, -1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["transformer", "perceiver-ar-v3", "llp"])
def test_a_window_feed_past_its_length_reads_the_last_window(name):
    model = model_of(name)
    n = SMALL["max_seq_len"]
    ids = torch.randint(0, 50, (3 * n + 7,))
    feeder = feeder_for(model)
    assert isinstance(feeder, WindowFeed)
    logits = fed(feeder, ids, [n + 3, 2 * n + 4])[-1]
    with torch.no_grad():
        torch.testing.assert_close(logits, model(ids[None, -n:])[0, -1])
    assert feeder.length == len(ids) and feeder.nbytes == n * 8  # the window's token ids


@pytest.mark.parametrize("name", ["segment-cache", "segment-cache-m8-k1"])
def test_segment_cache_feed_past_the_window_equals_its_stream(name):
    """Past max_seq_len only the stream defines the logits: the feed must equal it fed at once."""
    model = model_of(name)
    ids = torch.randint(0, 50, (3 * SMALL["max_seq_len"] + 5,))
    one = feeder_for(model).feed(ids.tolist())
    torch.testing.assert_close(fed(feeder_for(model), ids, [11, 70, 1, 115])[-1], one, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_rollback_and_restore_give_the_same_next_logits(name):
    model = model_of(name)
    ids = torch.randint(0, 50, (150,))
    feeder = feeder_for(model)
    feeder.feed(ids[:90].tolist())
    mark, saved = feeder.mark(), feeder.state_dict()
    first = feeder.feed(ids[90:].tolist())
    feeder.feed([1, 2, 3])
    feeder.rollback(mark)
    after = feeder.state_dict()
    assert feeder.length == 90 and after.keys() == saved.keys() and all(torch.equal(after[k], saved[k]) for k in saved)
    torch.testing.assert_close(feeder.feed(ids[90:].tolist()), first, rtol=0, atol=0)
    restored = feeder_for(model)
    restored.load_state_dict({k: v.clone() for k, v in saved.items()})
    torch.testing.assert_close(restored.feed(ids[90:].tolist()), first, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_state_grows_no_more_than_counted(name):
    """What the memory reserves before feeding (`growth`) covers what the state then adds, for
    feeds short and long, inside and past the window, and the bounded states never pass their bound."""
    model = model_of(name)
    feeder = feeder_for(model)
    for n in [1, 3, 8, 30, 64, 100, 1, 1]:
        before, reserved = feeder.nbytes, feeder.growth(n)
        feeder.feed(torch.randint(0, 50, (n,)).tolist())
        assert feeder.nbytes - before <= reserved  # a bounded state may shrink
        assert feeder.nbytes <= feeder_for(model).growth(feeder.length)  # bounded states stay in their bound


@pytest.mark.parametrize("name", ["long-short", "cf-both-p8"])
def test_a_reserved_segment_feed_copies_nothing_while_fed_in_pieces(name):
    """The state memory reserves a document (or an answer) before feeding it in pieces: the stores
    are copied once, into buffers whose bytes `growth` counted, and the pieces then write in place;
    the bytes reported are the buffers' (room included), and a rollback keeps them."""
    feeder = SegmentFeed(model_of(name))
    feeder.feed(torch.randint(0, 50, (40,)).tolist())
    before, reserved = feeder.nbytes, feeder.growth(150)
    mark = feeder.mark()
    feeder.reserve(150)
    stores = [g for layer in feeder.state.layers for g in layer.growables()]
    buffers = [g.data.data_ptr() for g in stores]
    room = sum(g.nbytes for g in stores)
    assert 0 < feeder.nbytes - before <= reserved
    for n in (1, 17, 64, 68):  # 150 tokens in all
        feeder.feed(torch.randint(0, 50, (n,)).tolist())
        assert [g.data.data_ptr() for g in stores] == buffers  # written in place
    assert sum(g.nbytes for g in stores) == room
    assert all(g.n == g.data.shape[1] for g in stores)  # the room was exactly what the 150 tokens needed
    feeder.rollback(mark)
    assert [g.data.data_ptr() for g in stores] == buffers and sum(g.nbytes for g in stores) == room  # the room is kept
    feeder.trim()
    assert feeder.nbytes == before  # and given back


SERVED = {
    "segment-cache": ("segment-cache", {"segment_len": 16, "memory_len": 32, "cache_segments": 4, "cache_top_k": 2}),
    "perceiver-ar-v3": ("perceiver-ar-v3", {"latent": 64, "history_compressed": 16}),
    "llp": ("llp", {"segment_len": 32}),
}


@pytest.mark.parametrize("name", list(SERVED))
def test_a_served_checkpoint_answers_from_the_fed_documents_and_after_a_restart(name, make_client, tmp_path):
    """Through the API: the session's default memory is `state`; its answer equals greedy decoding
    fed directly (documents longer than the model's window), and comes back the same after a restart."""
    arch, flags = SERVED[name]
    torch.manual_seed(0)
    model = build(arch, vocab_size=256, dim=32, n_layers=2, n_heads=2, max_seq_len=256, **flags)
    with torch.no_grad():
        model.embed.weight.mul_(5.0)  # logits wide enough that answers follow the context
    save_checkpoint(model, tmp_path / name, note="random weights, for tests")
    settings = dict(model=[str(tmp_path / name)], segment_len=512, data_dir=tmp_path / "sessions")
    client = make_client(**settings)
    session = client.post("/v1/sessions", json={"model": name}).json()
    assert session["memory"] == "state"
    doc = client.post(f"/v1/sessions/{session['id']}/documents", json={"text": TEXT}).json()
    assert doc["tokens"] == len(TEXT.encode())
    question = "Who was sitting by her sister?"
    body = {"question": question, "max_tokens": 12, "no_repeat_ngram_size": 0}  # plain greedy
    answer = client.post(f"/v1/sessions/{session['id']}/ask", json=body).json()["answer"]
    assert answer == greedy(model.eval(), TEXT, question, 12)
    cache = client.get(f"/v1/sessions/{session['id']}/cache").json()
    reach = feeder_for(model).reach()
    assert cache["entries"] == min(doc["tokens"], reach) and cache["capacity"] == reach and cache["bytes"] > 0
    assert cache["dropped_tokens"] == doc["tokens"] - reach
    assert f"pushed out {doc['tokens'] - reach:,} tokens" in doc["warning"]  # the text past the model's reach, said
    assert "reaches no further back" in doc["warning"] and "memory 'text'" not in doc["warning"]
    client.__exit__(None, None, None)
    restarted = make_client(**settings)
    assert restarted.post(f"/v1/sessions/{session['id']}/ask", json=body).json()["answer"] == answer
    assert restarted.get(f"/v1/sessions/{session['id']}/cache").json() == cache


def test_the_budget_refuses_a_feed_before_it_happens(make_client, tmp_path):
    """A segment-cache session whose budget is below one state copy: the document is refused
    (counted before anything is fed) and the session keeps what it had."""
    arch, flags = SERVED["segment-cache"]
    model = build(arch, vocab_size=256, dim=32, n_layers=2, n_heads=2, max_seq_len=256, **flags)
    save_checkpoint(model, tmp_path / "sc", note="random weights, for tests")
    client = make_client(model=[str(tmp_path / "sc")], session_memory_bytes=feeder_for(model).growth(1) - 1)
    # (a budget of growth(1) - 1 bytes: below what any feed is counted at)
    session = client.post("/v1/sessions", json={"model": "sc"}).json()["id"]
    refused = client.post(f"/v1/sessions/{session}/documents", json={"text": "a few words"})
    need = feeder_for(model).growth(1)  # one new state copy, whatever the document's length
    assert refused.status_code == 413 and f"needs {need} bytes of session memory" in refused.json()["error"]["message"]
    assert client.get(f"/v1/sessions/{session}/cache").json()["documents"] == 0
