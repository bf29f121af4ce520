"""A CacheFormer checkpoint served through the API: sessions feed documents through the model's
own state (the `state` memory), and answers continue from it."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from engine.prompts import render
from research.lms import build
from research.lms.lm_io import save_checkpoint
from tests.helpers import FIXTURES, fail_on_third_segment, greedy

TEXT = (FIXTURES / "alice29.txt").read_text(encoding="utf-8")[:3000]  # longer than max_seq_len
CONFIG = dict(
    vocab_size=256,
    dim=32,
    n_layers=2,
    n_heads=2,
    max_seq_len=256,
    window=32,
    segment_len=8,
    compressed_per_segment=2,
    group_size=16,
    overlap=True,
    cache_top_k=3,
    cache_neighbours=1,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = build("cacheformer", **CONFIG)
    with torch.no_grad():
        model.embed.weight.mul_(5.0)  # logits wide enough that sampled answers follow the context
    folder = tmp_path_factory.mktemp("lm") / "tiny-cacheformer"
    save_checkpoint(model, folder, note="random weights, for tests")
    return folder


@pytest.fixture
def lm_client(make_client, checkpoint, tiny_dir):
    return make_client(model=[str(checkpoint), str(tiny_dir)], segment_len=512)


def test_checkpoint_is_listed_with_the_state_memory(lm_client, checkpoint, tiny_dir):
    models = {m["id"]: m for m in lm_client.get("/v1/models").json()["data"]}
    lm = models[checkpoint.name]
    assert lm["architecture"] == "cacheformer" and lm["context_length"] == 256
    assert "state" in lm["memories"] and "neurocache" not in lm["memories"]
    assert "state" not in models[tiny_dir.name]["memories"]
    session = lm_client.post("/v1/sessions", json={"model": checkpoint.name}).json()
    assert session["memory"] == "state"
    refused = lm_client.post("/v1/sessions", json={"model": tiny_dir.name, "memory": "state"})
    assert refused.status_code == 400 and "CacheFormer" in refused.json()["error"]["message"]


def test_ingest_and_ask_continue_from_the_fed_document(lm_client, checkpoint):
    session = lm_client.post("/v1/sessions", json={"model": checkpoint.name}).json()["id"]
    doc = lm_client.post(f"/v1/sessions/{session}/documents", json={"text": TEXT}).json()
    assert doc["tokens"] == len(TEXT.encode()) and doc["segments"] == 6
    cache = lm_client.get(f"/v1/sessions/{session}/cache").json()
    assert cache["entries"] == doc["tokens"] and cache["bytes"] > 0
    body: dict[str, Any] = {
        "question": "Who was sitting by her sister?",
        "max_tokens": 12,
        "no_repeat_ngram_size": 0,
    }  # plain greedy
    answer = lm_client.post(f"/v1/sessions/{session}/ask", json=body).json()
    model = lm_client.app.state.engine.models.named(checkpoint.name).loaded.model
    assert answer["answer"] == greedy(model, TEXT, body["question"], 12)
    shorter = lm_client.post("/v1/sessions", json={"model": checkpoint.name}).json()["id"]
    lm_client.post(f"/v1/sessions/{shorter}/documents", json={"text": TEXT[:1500]})
    shorter_answer = lm_client.post(f"/v1/sessions/{shorter}/ask", json=body).json()["answer"]
    assert shorter_answer == greedy(model, TEXT[:1500], body["question"], 12)  # each session answers from its own text
    after = lm_client.get(f"/v1/sessions/{session}/cache").json()
    assert {**after, "bytes": 0} == {**cache, "bytes": 0}  # answering left the state as it was
    room = after["bytes"] - cache["bytes"]  # but for the room it made for an answer, kept for the next one
    tokenizer = lm_client.app.state.engine.models.named(checkpoint.name).loaded.tokenizer
    prompt = len(render(tokenizer, [{"role": "user", "content": body["question"]}])) + 2  # and the separator
    assert 0 < room <= after["bytes_per_token"] * (prompt + body["max_tokens"])
    again = lm_client.post(f"/v1/sessions/{session}/ask", json={**body, "stream": True}).text
    assert "event: retrieval" in again and "event: delta" in again and "event: done" in again


def test_failed_ingestion_rolls_the_state_back(lm_client, checkpoint):
    session = lm_client.post("/v1/sessions", json={"model": checkpoint.name}).json()["id"]
    lm_client.post(f"/v1/sessions/{session}/documents", json={"text": TEXT[:700]})
    before = lm_client.get(f"/v1/sessions/{session}/cache").json()
    memory = lm_client.app.state.engine.sessions.use(session).memory
    saved = memory.state.state_dict()
    fail_on_third_segment(memory)
    response = lm_client.post(f"/v1/sessions/{session}/documents?stream=true", json={"text": TEXT})
    assert "event: error" in response.text
    assert lm_client.get(f"/v1/sessions/{session}/cache").json() == before
    after = memory.state.state_dict()
    assert after.keys() == saved.keys() and all(torch.equal(after[k], saved[k]) for k in saved)


def test_a_session_saved_under_the_old_name_stream_comes_back_and_an_unknown_memory_is_skipped(
    make_client, checkpoint, tiny_dir, tmp_path
):
    """The `state` memory was named `stream` until 2026-11-23: a session saved then is read back as
    `state`. A saved session whose memory no installed code provides is skipped at start, not served."""
    settings = dict(model=[str(checkpoint), str(tiny_dir)], segment_len=512, data_dir=tmp_path / "sessions")
    client = make_client(**settings)
    old = client.post("/v1/sessions", json={"model": checkpoint.name}).json()["id"]
    client.post(f"/v1/sessions/{old}/documents", json={"text": TEXT[:1500]})
    body = {"question": "Who was sitting by her sister?", "max_tokens": 12, "no_repeat_ngram_size": 0}
    before = client.post(f"/v1/sessions/{old}/ask", json=body).json()["answer"]
    unknown = client.post("/v1/sessions", json={"model": tiny_dir.name, "memory": "text"}).json()["id"]
    client.__exit__(None, None, None)
    for session_id, kind in ((old, "stream"), (unknown, "no-such-memory")):
        manifest = tmp_path / "sessions" / session_id / "session.json"
        saved = json.loads(manifest.read_text())
        saved["session"]["memory"] = saved["session"]["cache"]["memory"] = kind
        manifest.write_text(json.dumps(saved))

    restarted = make_client(**settings)
    assert [s["id"] for s in restarted.get("/v1/sessions").json()["data"]] == [old]
    info = restarted.get(f"/v1/sessions/{old}").json()
    assert info["memory"] == info["cache"]["memory"] == "state" and info["resident"] is False
    assert restarted.post(f"/v1/sessions/{old}/ask", json=body).json()["answer"] == before
    assert restarted.get("/metrics").status_code == 200


def test_an_answer_counts_what_it_keeps_again_once_it_holds_the_session(make_client, checkpoint, tiny_dir):
    """What an answer keeps is counted at admission and again under the session's lock, where a
    document committed meanwhile has changed it: a recount over the budget stops the answer before
    it feeds anything."""
    budget = 4 * 1024**2
    client = make_client(model=[str(checkpoint), str(tiny_dir)], segment_len=512, session_memory_bytes=budget)
    session = client.post("/v1/sessions", json={"model": checkpoint.name}).json()["id"]
    client.post(f"/v1/sessions/{session}/documents", json={"text": TEXT[:700]})
    memory = client.app.state.engine.sessions.use(session).memory
    counts = iter([(1024, 0), (budget + 1, 0)])  # admitted small; grown past the budget under the lock
    memory.answer_bytes = lambda *args: next(counts)
    saved = memory.state.state_dict()
    body = {"question": "Who was sitting by her sister?", "max_tokens": 4, "stream": True}
    response = client.post(f"/v1/sessions/{session}/ask", json=body)
    assert "event: error" in response.text and "event: delta" not in response.text
    after = memory.state.state_dict()
    assert all(torch.equal(after[k], saved[k]) for k in saved)
    assert next(counts, None) is None  # counted twice
