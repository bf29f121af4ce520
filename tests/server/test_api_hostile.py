"""The requests fuzzing found to get a 500 or cost far more than they should: each now gets a
clear 4xx at once (or works), and what was there before is untouched."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.helpers import assert_error, new_session

CHAT = "/v1/chat/completions"


def chat(content: str = "Say hi.", **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


def ask_url(session_id: str) -> str:
    return f"/v1/sessions/{session_id}/ask"


def test_tiny_temperature_and_top_p_answer_as_greedy(client):
    session_id = new_session(client, memory="text")
    greedy = client.post(ask_url(session_id), json={"question": "hi", "max_tokens": 6}).json()["answer"]
    near_greedy: tuple[dict[str, Any], ...] = (
        {"temperature": 1e-300},
        {"temperature": 1e-6},
        {"temperature": 1.0, "top_p": 1e-300},
    )
    for fields in near_greedy:
        response = client.post(ask_url(session_id), json={"question": "hi", "max_tokens": 6, "seed": 1, **fields})
        assert response.status_code == 200, (fields, response.text)
        assert response.json()["answer"] == greedy
        assert client.post(CHAT, json=chat(**fields)).status_code == 200


def test_seeds_are_bounded(shared_client):
    assert shared_client.post(CHAT, json=chat(temperature=1.0, seed=2**64 - 1)).status_code == 200
    assert shared_client.post(CHAT, json=chat(temperature=1.0, seed=-1)).status_code == 200
    assert_error(shared_client.post(CHAT, json=chat(seed=2**64)), 422, "validation_error")
    assert_error(shared_client.post(CHAT, json=chat(seed=-(2**63) - 1)), 422)


def test_lone_surrogates_are_422_everywhere(client):
    session_id = new_session(client, memory="text")
    raw = '"hi \\ud800 there"'  # a JSON escape no UTF-8 text can hold
    bodies = [
        (CHAT, '{"messages": [{"role": "user", "content": RAW}]}'.replace("RAW", raw)),
        (ask_url(session_id), '{"question": RAW}'.replace("RAW", raw)),
        (f"/v1/sessions/{session_id}/documents", '{"text": RAW}'.replace("RAW", raw)),
        ("/v1/sessions", '{"memory": RAW}'.replace("RAW", raw)),
    ]
    for url, body in bodies:
        error = assert_error(client.post(url, content=body, headers={"content-type": "application/json"}), 422)
        assert any(word in error["message"] for word in ("surrogate", "unicode", "escape")), (url, error)
    assert client.get(f"/v1/sessions/{session_id}").json()["documents"] == []


@pytest.mark.parametrize(
    "fields",
    [
        {"stream": 0},
        {"stream": "true"},
        {"seed": False},
        {"temperature": False},
        {"max_tokens": True},
        {"max_tokens": 2.5},
        {"temperature": "0.5"},
        {"stop": ["x"] * 9},
        {"stop": "x" * 257},
        {"no_repeat_ngram_size": -1},
        {"no_repeat_ngram_size": 65},
        {"no_repeat_ngram_size": 1.5},
        {"no_repeat_ngram_size": True},
        {"repetition_penalty": 0.5},
        {"repetition_penalty": 2.5},
        {"repetition_penalty": "1.1"},
        {"ignore_eos": "true"},
        {"ignore_eos": 1},
    ],
)
def test_strict_scalars(shared_client, fields):
    assert_error(shared_client.post(CHAT, json=chat(**fields)), 422, "validation_error")
    session_id = new_session(shared_client, memory="text")
    assert_error(shared_client.post(ask_url(session_id), json={"question": "q", **fields}), 422)


def test_non_finite_floats_are_422(shared_client):
    for value in ("NaN", "Infinity", "-Infinity", "1e999"):
        body = '{"messages": [{"role": "user", "content": "hi"}], "temperature": VALUE}'.replace("VALUE", value)
        assert_error(shared_client.post(CHAT, content=body, headers={"content-type": "application/json"}), 422)


def test_wrongly_typed_memory_options_get_a_plain_message(shared_client):
    for options, needle in (
        ({"top_k": 1.5}, "top_k: Input should be a valid integer"),
        ({"top_k": "x"}, "top_k: Input should be a valid integer"),
        ({"top_k": True}, "top_k"),
        ({"chunk_tokens": None}, "chunk_tokens"),
    ):
        error = assert_error(
            shared_client.post("/v1/sessions", json={"memory": "text", "options": options}), 400, "invalid_request"
        )
        assert needle in error["message"] and "TypeError" not in error["message"] and "__init__" not in error["message"]


def test_out_of_range_ranking_options_are_400_and_name_the_option(client):
    for options, needle in (
        ({"sentence_share": 1.5}, "sentence_share must be between 0 and 1"),
        ({"sentence_share": -0.1}, "sentence_share must be between 0 and 1"),
        ({"sentence_share": "x"}, "sentence_share"),
        ({"dense_weight": 2}, "dense_weight must be between 0 and 1"),
        ({"margin": 101}, "margin must be between 0 (off) and 100"),
    ):
        error = assert_error(client.post("/v1/sessions", json={"memory": "text", "options": options}), 400, "invalid_request")
        assert needle in error["message"]
    assert client.get("/v1/sessions").json()["data"] == []  # none of them made a session


def test_neurocache_capacity_is_typed_and_budgeted(make_client, adapter_dir):  # noqa: F811
    client = make_client(
        adapter_dir=[str(adapter_dir)], session_memory_bytes=2_000_000, max_memory_bytes=3_000_000, persist_sessions=False
    )
    error = assert_error(client.post("/v1/sessions", json={"memory": "neurocache", "options": {"capacity": 1.5}}), 400)
    assert "capacity: Input should be a valid integer" in error["message"]
    huge = {"memory": "neurocache", "options": {"capacity": 4_000_000}}
    assert "a session may hold 2000000" in assert_error(client.post("/v1/sessions", json=huge), 413, "too_large")["message"]
    # 30,000 states of the tiny adapter's 8 float32 numbers and two int64 counters: 1.44 MB each
    body = {"memory": "neurocache", "options": {"capacity": 30_000}}
    sessions = [client.post("/v1/sessions", json=body) for _ in range(3)]
    assert [r.status_code for r in sessions[:2]] == [201, 201]
    assert_error(sessions[2], 429, "memory_budget_exceeded")
    assert int(sessions[2].headers["Retry-After"]) >= 1
    assert len(client.get("/v1/sessions").json()["data"]) == 2
    client.delete(f"/v1/sessions/{sessions[0].json()['id']}")
    assert client.post("/v1/sessions", json=body).status_code == 201


def test_with_sessions_on_disk_the_budget_evicts_the_least_recently_used(make_client, adapter_dir):  # noqa: F811
    client = make_client(adapter_dir=[str(adapter_dir)], session_memory_bytes=2_000_000, max_memory_bytes=3_000_000)
    body = {"memory": "neurocache", "options": {"capacity": 30_000}}
    first, second, third = (client.post("/v1/sessions", json=body).json()["id"] for _ in range(3))
    resident = {s["id"]: s["resident"] for s in client.get("/v1/sessions").json()["data"]}
    assert resident == {first: False, second: True, third: True}
    text = {"text": "The lighthouse of Velmora is painted violet."}
    assert client.post(f"/v1/sessions/{first}/documents", json=text).status_code == 201  # loaded back
    resident = {s["id"]: s["resident"] for s in client.get("/v1/sessions").json()["data"]}
    assert resident == {first: True, second: False, third: True}
    assert client.get(f"/v1/sessions/{first}").json()["documents"][0]["chars"] == len(text["text"])


def test_a_huge_chat_message_is_refused_before_it_is_read(make_client):
    client = make_client(max_request_bytes=1_000_000, max_prompt_chars=50_000)
    started = time.perf_counter()
    assert_error(client.post(CHAT, json=chat("word " * 2_000_000)), 413, "too_large")  # 10 MB
    assert time.perf_counter() - started < 2.0
    # under the body limit, over the prompt's characters: refused before tokenizing
    assert "LONGDOC_MAX_PROMPT_CHARS" in assert_error(client.post(CHAT, json=chat("word " * 20_000)), 413)["message"]
    session_id = new_session(client, memory="text")
    assert_error(client.post(ask_url(session_id), json={"question": "word " * 20_000}), 413)


def test_a_body_without_content_length_is_cut_off_at_the_limit(make_client):
    client = make_client(max_request_bytes=10_000)

    def chunks():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"}]}'

    response = client.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert_error(response, 413, "too_large")


def test_a_document_over_the_token_limit_is_refused_early(make_client):
    client = make_client(max_document_tokens=1000)
    session_id = new_session(client, memory="text")
    url = f"/v1/sessions/{session_id}/documents"
    kept = client.post(url, json={"text": "The lighthouse is violet."}).json()
    error = assert_error(client.post(url, content="word " * 400_000, headers={"content-type": "text/plain"}), 413)
    assert "more than 1000 tokens" in error["message"]
    assert [d["id"] for d in client.get(url).json()["data"]] == [kept["id"]]


def test_text_plain_charset_is_honoured(client):
    session_id = new_session(client, memory="text")
    url = f"/v1/sessions/{session_id}/documents"
    text = "Le phare de Velmora est peint en violet, café compris."
    for charset in ("utf-16", "latin-1"):
        body = text.encode(charset)
        response = client.post(url, content=body, headers={"content-type": f"text/plain; charset={charset}"})
        assert response.status_code == 201, response.text
        assert response.json()["chars"] == len(text)
    assert_error(client.post(url, content=b"x", headers={"content-type": "text/plain; charset=klingon"}), 415)


def test_405_lists_every_method(shared_client):
    session_id = new_session(shared_client, memory="text")
    response = shared_client.post(f"/v1/sessions/{session_id}")
    assert_error(response, 405, "method_not_allowed")
    assert response.headers["Allow"] == "DELETE, GET"


def test_documents_route_declares_its_bodies(shared_client):
    body = shared_client.get("/openapi.json").json()["paths"]["/v1/sessions/{session_id}/documents"]["post"]["requestBody"]
    files = {"application/pdf", "application/epub+zip", "text/html", "text/markdown", "application/octet-stream"}
    assert {"application/json", "multipart/form-data", "text/plain"} | files <= set(body["content"])
    assert json.dumps(body).count('"text"') >= 1
