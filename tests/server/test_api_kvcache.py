"""kvcache sessions through the API, on the tiny model: options, provenance, read-only answers,
rollback of a failed ingestion, budgets."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.memories.kvcache.memory import SEPARATOR
from tests.helpers import FIXTURES, assert_error, fail_on_third_segment, new_session, session_of

TEXT = (FIXTURES / "alice29.txt").read_text(encoding="utf-8")[:6000]
SIZES = {"segment_len": 16, "top_k": 2, "neighbours": 3, "window": 64, "sinks": 8, "query_chunk": 16}
SMALL = {**SIZES, "selection": "summary"}  # each layer selects (by default the text index picks)
QUESTION = {"question": "Where did the rabbit go?", "max_tokens": 8}


def test_answers_come_from_selected_segments_and_leave_the_store_as_it_was(client):
    assert "kvcache" in client.get("/v1/models").json()["data"][0]["memories"]
    session = new_session(client, memory="kvcache", options=SMALL)
    doc = client.post(f"/v1/sessions/{session}/documents", json={"text": TEXT}).json()
    cache = client.get(f"/v1/sessions/{session}/cache").json()
    assert cache["memory"] == "kvcache" and cache["documents"] == 1
    assert cache["entries"] > doc["tokens"]  # the chat template's start is streamed before it
    assert cache["bytes_per_token"] > 0 and cache["bytes"] >= doc["tokens"] * cache["bytes_per_token"] * 0.9
    first = client.post(f"/v1/sessions/{session}/ask", json=QUESTION).json()
    items = first["retrieval"]["items"]
    assert first["retrieval"]["memory"] == "kvcache" and items
    assert all(1 <= item["layers"] <= 2 and item["document_id"] == doc["id"] for item in items)
    assert all(0 <= item["char_start"] < item["char_end"] <= len(TEXT) for item in items)
    assert [item["char_start"] for item in items] == sorted(item["char_start"] for item in items)
    again = client.post(f"/v1/sessions/{session}/ask", json=QUESTION).json()
    assert again["answer"] == first["answer"] and again["retrieval"]["items"] == items
    assert client.get(f"/v1/sessions/{session}/cache").json() == cache
    streamed = client.post(f"/v1/sessions/{session}/ask", json={**QUESTION, "stream": True}).text
    assert "event: retrieval" in streamed and "event: done" in streamed


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"top_k": 0}, "top_k"),
        ({"storage": "fp8"}, "storage"),
        ({"summary": "max"}, "summary"),
        ({"query_pool": "sum"}, "query_pool"),
        ({"selection": "all"}, "selection"),
        ({"window": 16, "segment_len": 32}, "window must be at least segment_len"),
        ({"window": 4000}, "positions"),
        ({"top_k": 1.5}, "top_k"),
        ({"sink": 4}, "unknown memory options"),
        ({"vote": "yes"}, "vote"),
        ({"vote": True, "selection": "text"}, "vote needs a selection that scores"),
        ({"reselect_every": -1}, "reselect_every"),
    ],
)
def test_bad_options_are_400(shared_client, options, message):
    response = shared_client.post("/v1/sessions", json={"memory": "kvcache", "options": options})
    assert message in assert_error(response, 400)["message"]


@pytest.mark.parametrize("selection", ["summary", "text"])
def test_a_failed_ingestion_leaves_earlier_documents_exact(client, selection):
    session = new_session(client, memory="kvcache", options={**SMALL, "selection": selection})
    client.post(f"/v1/sessions/{session}/documents", json={"text": TEXT[:3000]})
    before = client.get(f"/v1/sessions/{session}/cache").json()
    answer = client.post(f"/v1/sessions/{session}/ask", json=QUESTION).json()
    fail_on_third_segment(client.app.state.engine.sessions.use(session).memory)
    response = client.post(f"/v1/sessions/{session}/documents?stream=true", json={"text": TEXT * 2})
    assert "event: error" in response.text
    assert client.get(f"/v1/sessions/{session}/cache").json() == before
    after = client.post(f"/v1/sessions/{session}/ask", json=QUESTION).json()
    assert after["answer"] == answer["answer"] and after["retrieval"] == {
        **answer["retrieval"],
        "seconds": after["retrieval"]["seconds"],
    }
    # the token ids `reread` runs again stay row for row with the store: rolled back, then appended
    second = TEXT[3000:4000]
    client.post(f"/v1/sessions/{session}/documents", json={"text": second})
    memory = session_of(client, session).memory
    tokenizer = client.app.state.engine.tokenizer()
    fed = tokenizer(SEPARATOR, add_special_tokens=False)["input_ids"] + tokenizer(second, add_special_tokens=False)["input_ids"]
    assert len(memory._token_ids) == memory.store.tokens and memory._token_ids[-len(fed) :].tolist() == fed


def test_the_session_budget_refuses_a_document_before_it_is_streamed(make_client):
    client = make_client(session_memory_bytes=200_000)
    session = new_session(client, memory="kvcache", options=SMALL)
    response = client.post(f"/v1/sessions/{session}/documents", json={"text": TEXT})
    assert_error(response, 413, "too_large")
    assert client.get(f"/v1/sessions/{session}/cache").json()["entries"] == 0


def test_an_empty_session_answers_from_the_question_alone(client):
    session = new_session(client, memory="kvcache", options=SMALL)
    answer = client.post(f"/v1/sessions/{session}/ask", json=QUESTION).json()
    assert answer["retrieval"] == {"memory": "kvcache", "items": [], "seconds": 0.0, "strategy": None}
    assert answer["usage"]["completion_tokens"] >= 1
    assert client.get(f"/v1/sessions/{session}/cache").json()["entries"] == 0


def test_token_at_inverts_the_offsets_the_retrieval_items_carry(client):
    session = new_session(client, memory="kvcache", options=SMALL)
    client.post(f"/v1/sessions/{session}/documents", json={"text": TEXT})
    client.post(f"/v1/sessions/{session}/documents", json={"text": "A second document."})
    items = client.post(f"/v1/sessions/{session}/ask", json=QUESTION).json()["retrieval"]["items"]
    memory = session_of(client, session).memory
    sinks, length = SIZES["sinks"], SIZES["segment_len"]
    for item in items:  # a segment's first and last characters lie in its own rows
        for char in (item["char_start"], item["char_end"] - 1):
            row = memory.token_at(0, char)
            assert row is not None and (row - sinks) // length == item["chunk_id"]
    assert memory.token_at(1, 0) > memory.token_at(0, len(TEXT) - 1)  # the second document comes after
    assert memory.token_at(0, len(TEXT)) is None and memory.token_at(2, 0) is None


def test_selection_by_text_attends_the_text_indexs_best_chunks_in_every_layer(client):
    """selection "text": the segments of the text index's best chunks for the question, in every
    layer (2 in the tiny model), k·u of them; the index's bytes count in the session's."""
    options = {**SMALL, "selection": "text"}
    session = new_session(client, memory="kvcache", options=options)
    plain = new_session(client, memory="kvcache", options=SMALL)
    for s in (session, plain):
        client.post(f"/v1/sessions/{s}/documents", json={"text": TEXT})
    question = {"question": "What did the Dodo say about the Caucus-race?", "max_tokens": 8}
    items = client.post(f"/v1/sessions/{session}/ask", json=question).json()["retrieval"]["items"]
    memory = session_of(client, session).memory
    assert len(items) == SIZES["top_k"] * SIZES["neighbours"] and all(item["layers"] == 2 for item in items)
    _, start, end, _ = memory.text_index.ranked_spans(question["question"])[0]
    assert any(item["char_start"] < end and start < item["char_end"] for item in items)  # the best chunk is attended
    with_index, without = (client.get(f"/v1/sessions/{s}/cache").json()["bytes"] for s in (session, plain))
    assert with_index > without


def test_the_text_index_ranks_with_the_models_text_options(make_client, tiny_dir, tmp_path):
    """selection "text": kvcache's text index takes the `text` memory's defaults from the model's
    manifest; with its margin only the chunks within it of the first are picked, and the answer
    attends fewer segments than the layout's k·u places."""
    measured = tmp_path / tiny_dir.name
    shutil.copytree(tiny_dir, measured)
    (measured / "longdoc.json").write_text(
        json.dumps({"memory_options": {"text": {"margin": 0.001, "dense_weight": 0.4, "sentence_share": 0.5}}})
    )
    client = make_client(model=[str(measured)])
    session = new_session(client, memory="kvcache", options={**SIZES, "selection": "text"})
    client.post(f"/v1/sessions/{session}/documents", json={"text": TEXT})
    question = {"question": "What did the Dodo say about the Caucus-race?", "max_tokens": 8}
    items = client.post(f"/v1/sessions/{session}/ask", json=question).json()["retrieval"]["items"]
    text_index = session_of(client, session).memory.text_index
    assert (text_index.options.margin, text_index.options.dense_weight, text_index.options.sentence_share) == (0.001, 0.4, 0.5)
    assert len(text_index.store.sentences.vectors) > 0  # kept, so the share ranks with them
    (_, start, end, best), (_, _, _, second) = text_index.ranked_spans(question["question"])[:2]
    assert best - second > 0.001  # the second chunk lies outside the margin
    assert 0 < len(items) < SIZES["top_k"] * SIZES["neighbours"]
    assert all(item["char_start"] < end and start < item["char_end"] for item in items)  # the best chunk's segments only
