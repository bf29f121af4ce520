"""The REST API through the ASGI app with its lifespan, on a tiny random model."""

from __future__ import annotations

import json

import pytest

from engine.interface import GenerationParams
from server.routes.ask import generation_params
from server.schemas import AskRequest, ChatCompletionRequest
from tests.helpers import TEXT, events_of, make_tiny_llama, new_session


def test_health_and_models(shared_client, tiny_dir):
    assert shared_client.get("/healthz").json() == {"status": "ok"}
    assert shared_client.get("/readyz").json() == {"status": "ready"}
    models = shared_client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [tiny_dir.name]
    assert models["data"][0]["context_length"] == 4096


def test_session_lifecycle(client):
    session_id = new_session(client, memory="truncate", options={"window_tokens": 256})
    info = client.get(f"/v1/sessions/{session_id}").json()
    assert info["memory"] == "truncate" and info["options"] == {"window_tokens": 256}
    assert info["cache"] == {
        "memory": "truncate",
        "entries": 0,
        "bytes": 0,
        "capacity": 256,
        "documents": 0,
        "turns": 0,
        "dropped_tokens": 0,
        "bytes_per_token": 12,
        "summaries": 0,
        "summaries_planned": 0,
        "summary_state": None,
    }
    assert [s["id"] for s in client.get("/v1/sessions").json()["data"]] == [session_id]
    assert client.delete(f"/v1/sessions/{session_id}").status_code == 204
    assert client.get(f"/v1/sessions/{session_id}").status_code == 404


def test_document_json_multipart_and_plain_text(shared_client):
    session_id = new_session(shared_client, memory="text")
    url = f"/v1/sessions/{session_id}/documents"
    first = shared_client.post(url, json={"text": TEXT, "name": "alice"})
    assert first.status_code == 201, first.text
    doc = first.json()
    assert doc["name"] == "alice" and doc["chars"] == len(TEXT) and doc["tokens"] > 4000
    assert doc["segments"] == -(-doc["tokens"] // 64)
    second = shared_client.post(url, files={"file": ("part.txt", b"A second document.", "text/plain")})
    assert second.status_code == 201 and second.json()["name"] == "part.txt"
    third = shared_client.post(url, content="Plain text body.", headers={"content-type": "text/plain"})
    assert third.status_code == 201
    listed = shared_client.get(url).json()["data"]
    assert [d["id"] for d in listed] == [doc["id"], second.json()["id"], third.json()["id"]]
    detail = shared_client.get(f"{url}/{doc['id']}").json()
    assert {k: v for k, v in detail.items() if k not in ("outline", "pages")} == doc and detail["pages"] == []
    assert doc["format"] == "text" and doc["page_count"] == 0  # plain text: no pages, its chapter lines as sections
    assert [s["title"] for s in detail["outline"]] == ["CHAPTER I", "CHAPTER II"]
    assert doc["section_count"] == 2 and all(TEXT[s["char_start"] :].startswith(s["title"]) for s in detail["outline"])
    cache = shared_client.get(f"/v1/sessions/{session_id}/cache").json()
    assert cache["documents"] == 3 and cache["entries"] > 0 and cache["bytes"] > len(TEXT)


def test_ingestion_progress_stream(shared_client):
    session_id = new_session(shared_client, memory="text")
    response = shared_client.post(f"/v1/sessions/{session_id}/documents?stream=true", json={"text": TEXT[:5000]})
    events = events_of(response)
    progress = [e.data for e in events if e.event == "progress"]
    assert [p["segments_done"] for p in progress] == list(range(1, len(progress) + 1))
    assert progress[-1]["tokens_done"] == progress[-1]["tokens_total"]
    assert events[-1].event == "done" and events[-1].data["tokens"] == progress[-1]["tokens_total"]


def test_ask_streams_retrieval_deltas_done_and_matches_non_streamed(shared_client):
    session_id = new_session(shared_client, memory="text")
    shared_client.post(f"/v1/sessions/{session_id}/documents", json={"text": TEXT})
    body = {"question": "Who did Alice follow down the hole?", "max_tokens": 12}
    events = events_of(shared_client.post(f"/v1/sessions/{session_id}/ask", json={**body, "stream": True}))
    names = [e.event for e in events]
    assert names[0] == "retrieval" and names[-1] == "done" and set(names[1:-1]) <= {"delta"}
    items = events[0].data["items"]
    assert items and all(0 <= i["char_start"] < i["char_end"] <= len(TEXT) for i in items)
    streamed = "".join(e.data["text"] for e in events if e.event == "delta")
    done = events[-1].data
    assert done["usage"]["completion_tokens"] <= 12 and done["timings"]["ttft_seconds"] > 0
    plain = shared_client.post(f"/v1/sessions/{session_id}/ask", json=body).json()
    assert plain["answer"] == streamed  # greedy decoding is deterministic
    assert plain["retrieval"]["items"] == items
    assert plain["retrieval"]["strategy"] == events[0].data["strategy"] == "ranked"  # no gathering asked for
    assert plain["usage"] == done["usage"]


def test_ask_with_stop_string(shared_client):
    session_id = new_session(shared_client, memory="truncate")
    shared_client.post(f"/v1/sessions/{session_id}/documents", json={"text": TEXT[:3000]})
    full = shared_client.post(f"/v1/sessions/{session_id}/ask", json={"question": "q?", "max_tokens": 16}).json()["answer"]
    assert len(full) > 4
    stop = full[2:4]
    cut = shared_client.post(f"/v1/sessions/{session_id}/ask", json={"question": "q?", "max_tokens": 16, "stop": stop}).json()
    assert cut["finish_reason"] == "stop" and stop not in cut["answer"] and full.startswith(cut["answer"])


def test_clear_cache(shared_client):
    session_id = new_session(shared_client, memory="text")
    shared_client.post(f"/v1/sessions/{session_id}/documents", json={"text": TEXT[:3000]})
    cleared = shared_client.delete(f"/v1/sessions/{session_id}/cache").json()
    assert cleared["entries"] == 0 and cleared["documents"] == 0
    assert shared_client.get(f"/v1/sessions/{session_id}").json()["documents"] == []


def test_chat_completions_plain_and_with_session(shared_client):
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 0}
    plain = shared_client.post("/v1/chat/completions", json=body).json()
    assert plain["object"] == "chat.completion"
    assert plain["choices"][0]["message"]["role"] == "assistant"
    assert plain["usage"]["completion_tokens"] <= 6
    session_id = new_session(shared_client, memory="text")
    shared_client.post(f"/v1/sessions/{session_id}/documents", json={"text": TEXT[:4000]})
    with_session = shared_client.post("/v1/chat/completions", json={**body, "session_id": session_id}).json()
    assert with_session["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 100
    stream = shared_client.post("/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    lines = [line for line in stream.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["usage"] == plain["usage"] and chunks[-2]["choices"][0]["finish_reason"] is not None
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]


def test_openai_sdk_works_as_a_client(shared_client):
    openai = pytest.importorskip("openai")
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=shared_client)
    assert [m.id for m in sdk.models.list().data]
    messages = [{"role": "user", "content": "Say something."}]
    reply = sdk.chat.completions.create(model=sdk.models.list().data[0].id, messages=messages, max_tokens=5, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens <= 5
    chunks = list(sdk.chat.completions.create(model=reply.model, messages=messages, max_tokens=5, temperature=0, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content


def test_two_models_side_by_side(make_client, tiny_dir, tmp_path):
    other = make_tiny_llama(tmp_path / "other-tiny", tiny_dir, seed=1)
    client = make_client(model=[str(tiny_dir), str(other)])
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [tiny_dir.name, "other-tiny"]
    assert client.get(f"/v1/sessions/{new_session(client)}").json()["model"] == tiny_dir.name
    assert client.get(f"/v1/sessions/{new_session(client, model='other-tiny')}").json()["model"] == "other-tiny"


def test_metrics_after_traffic(client):
    session_id = new_session(client, memory="text")
    client.post(f"/v1/sessions/{session_id}/documents", json={"text": TEXT[:3000]})
    events_of(client.post(f"/v1/sessions/{session_id}/ask", json={"question": "q", "max_tokens": 5, "stream": True}))
    text = client.get("/metrics").text
    for series in (
        'longdoc_time_to_first_token_seconds_count{endpoint="ask"} 1.0',
        'longdoc_e2e_request_latency_seconds_count{endpoint="ask"} 1.0',
        'longdoc_retrieval_latency_seconds_count{memory="text"} 1.0',
        'longdoc_ingestion_tokens_per_second_count{memory="text"} 1.0',
        "longdoc_active_sessions 1.0",
        'longdoc_requests_total{method="POST",route="/v1/sessions/{session_id}/ask",status="200"} 1.0',
    ):
        assert series in text, series
    assert "longdoc_inter_token_latency_seconds_bucket" in text
    assert 'longdoc_queue_depth{worker="embedder"} 0.0' in text
    assert session_id not in text
    prompt = [line for line in text.splitlines() if line.startswith('longdoc_prompt_tokens_total{endpoint="ask"}')]
    assert prompt and float(prompt[0].split()[-1]) > 100


def test_the_same_document_and_question_give_the_same_excerpts_and_greedy_answer(make_client):
    """Across sessions and across server starts: retrieval ties break by chunk number, decoding is greedy."""
    answers = []
    for _ in range(2):
        client = make_client()
        for _ in range(2):
            session_id = new_session(client, memory="text")
            client.post(f"/v1/sessions/{session_id}/documents", json={"text": TEXT[:8_000]})  # 33 chunks to rank
            body = client.post(
                f"/v1/sessions/{session_id}/ask",
                json={"question": "What did the White Rabbit take out of its waistcoat-pocket?", "max_tokens": 12},
            ).json()
            items = [
                {k: v for k, v in item.items() if k != "document_id"} for item in body["retrieval"]["items"]
            ]  # ids are per upload
            answers.append((body["answer"], items))
    assert all(a == answers[0] for a in answers) and answers[0][1]


def test_a_memory_that_cannot_keep_the_whole_document_says_so(client):
    session_id = new_session(client, memory="truncate", options={"window_tokens": 256})
    document = client.post(f"/v1/sessions/{session_id}/documents", json={"text": TEXT}).json()
    assert document["warning"] and f"this document has {document['tokens']:,}" in document["warning"]
    cache = client.get(f"/v1/sessions/{session_id}/cache").json()
    assert cache["dropped_tokens"] == document["tokens"] - 256 and cache["entries"] == 256
    whole = new_session(client, memory="text")
    assert client.post(f"/v1/sessions/{whole}/documents", json={"text": TEXT}).json()["warning"] is None
    assert client.get(f"/v1/sessions/{whole}/cache").json()["dropped_tokens"] == 0


def test_both_routes_hand_the_engine_the_same_sampling_fields():
    fields = {
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 3,
        "stop": "x",
        "no_repeat_ngram_size": 0,
        "repetition_penalty": 1.2,
        "ignore_eos": True,
    }
    ask = generation_params(AskRequest.model_validate({"question": "q", **fields}), 7)
    chat = generation_params(ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "q"}], **fields}), 7)
    expected = GenerationParams(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        seed=3,
        stop=("x",),
        no_repeat_ngram_size=0,
        repetition_penalty=1.2,
        ignore_eos=True,
    )
    assert ask == chat == expected
