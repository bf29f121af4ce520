"""Neurocache sessions through the API, on a tiny model with an adapter whose gates are open."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.config import DEFAULT_MODEL, SMALL_MODEL
from engine.models.manifest import SHIPPED_MANIFESTS
from tests.helpers import FIXTURES, fail_on_third_segment

TEXT = (FIXTURES / "alice29.txt").read_text(encoding="utf-8")[:6000]


def test_the_default_memory_is_the_one_the_model_manifest_names(make_client, adapter_dir, tiny_dir, tmp_path):
    """Measured defaults live in the model's manifest (longdoc.json), not in the code; unmeasured: text."""
    client = make_client(adapter_dir=[str(adapter_dir)])
    assert "neurocache" in client.get("/v1/models").json()["data"][0]["memories"]
    assert client.post("/v1/sessions", json={}).json()["memory"] == "text"
    measured = tmp_path / tiny_dir.name
    shutil.copytree(tiny_dir, measured)
    (measured / "longdoc.json").write_text(json.dumps({"default_memory": "neurocache"}))
    client = make_client(model=[str(measured)], adapter_dir=[str(adapter_dir)])
    session = client.post("/v1/sessions", json={}).json()
    assert session["memory"] == "neurocache"
    assert session["cache"]["capacity"] == 4096 and session["cache"]["entries"] == 0
    # a manifest naming a memory the model cannot run (no adapter here), or an unreadable one: text
    assert make_client(model=[str(measured)]).post("/v1/sessions", json={}).json()["memory"] == "text"
    (measured / "longdoc.json").write_text("{not json")
    assert (
        make_client(model=[str(measured)], adapter_dir=[str(adapter_dir)]).post("/v1/sessions", json={}).json()["memory"]
        == "text"
    )


def test_a_manifest_sets_a_memorys_default_options_and_a_request_overrides_them(make_client, tiny_dir, tmp_path):
    """`memory_options` in the manifest are a memory's defaults on that model, key by key under the request's."""
    measured = tmp_path / tiny_dir.name
    shutil.copytree(tiny_dir, measured)
    (measured / "longdoc.json").write_text(json.dumps({"memory_options": {"text": {"top_k": 1, "rrf_k": 30}}}))
    client = make_client(model=[str(measured)])
    assert client.post("/v1/sessions", json={}).json()["options"] == {"top_k": 1, "rrf_k": 30}
    chosen = client.post("/v1/sessions", json={"memory": "text", "options": {"top_k": 3}}).json()["options"]
    assert chosen == {"top_k": 3, "rrf_k": 30}
    assert client.post("/v1/sessions", json={"memory": "truncate"}).json()["options"] == {}  # another kind: untouched
    reranking = client.post("/v1/sessions", json={"options": {"rerank": 4, "margin": 2.0}})  # a margin, inert with rerank
    assert reranking.status_code == 201, reranking.text

    def excerpt_chars(options: dict) -> int:
        """Characters of the excerpts an answer was given (touching chunks are one excerpt)."""
        session = client.post("/v1/sessions", json={"options": options}).json()["id"]
        text = " ".join(f"Paragraph {i} tells of the harbour lamp and its keeper." for i in range(200))
        assert client.post(f"/v1/sessions/{session}/documents", json={"text": text}).status_code == 201
        body = {"question": "Who kept the harbour lamp?", "max_tokens": 2}
        items = client.post(f"/v1/sessions/{session}/ask", json=body).json()["retrieval"]["items"]
        return sum(item["char_end"] - item["char_start"] for item in items)

    one, three = excerpt_chars({}), excerpt_chars({"top_k": 3})  # the manifest's top_k reaches the memory
    assert 0 < one and 2.5 * one < three


def test_a_manifests_bad_memory_options_are_logged_at_startup_and_left_out(make_client, tiny_dir, tmp_path, caplog):
    """Options a memory refuses, or for a memory the server lacks, are named in the log when the
    model loads; sessions get the code's defaults for that memory, and the manifest's good options."""
    measured = tmp_path / tiny_dir.name
    shutil.copytree(tiny_dir, measured)
    bad = {"text": {"top_k": 0}, "truncate": {"window_tokens": 512}, "nosuch": {"x": 1}}
    (measured / "longdoc.json").write_text(json.dumps({"memory_options": bad}))
    with caplog.at_level("WARNING", logger="engine.runtime.registry"):
        client = make_client(model=[str(measured)])
    logged = " ".join(r.getMessage() for r in caplog.records if r.name == "engine.runtime.registry")
    assert "options for memory 'text'" in logged and "top_k" in logged and "'nosuch'" in logged
    assert "memory 'truncate'" not in logged
    assert client.post("/v1/sessions", json={}).json()["options"] == {}
    assert client.post("/v1/sessions", json={"memory": "truncate"}).json()["options"] == {"window_tokens": 512}


def test_openai_requests_without_temperature_get_the_manifests_else_openais(make_client, tiny_dir, tmp_path, caplog):
    """`generation` in the manifest is the sampling of chat requests that leave it out (as vLLM's
    generation config); without one they sample at OpenAI's temperature 1; a request's own wins."""
    body = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8}

    def answers(client, **fields) -> list[str]:
        return [
            client.post("/v1/chat/completions", json={**body, **fields, "seed": seed}).json()["choices"][0]["message"]["content"]
            for seed in (1, 2, 3)
        ]

    unmeasured = make_client()
    assert len(set(answers(unmeasured))) > 1  # sampled: the seeds differ
    greedy = answers(unmeasured, temperature=0)
    assert len(set(greedy)) == 1
    measured = tmp_path / tiny_dir.name
    shutil.copytree(tiny_dir, measured)
    (measured / "longdoc.json").write_text(json.dumps({"generation": {"temperature": 0, "top_k": 5}}))
    with caplog.at_level("WARNING", logger="engine.models.manifest"):
        client = make_client(model=[str(measured)])
    assert answers(client) == greedy  # the manifest's greedy, whatever the seed
    assert len(set(answers(client, temperature=1.0))) > 1  # the request's own temperature wins
    assert "generation top_k" in caplog.text  # a key it does not know is named and left out


@pytest.mark.parametrize("name", [DEFAULT_MODEL, SMALL_MODEL])
def test_the_shipped_models_manifests_decode_greedily_as_they_were_measured(name):
    from engine.models import manifest as manifests

    shipped = manifests.manifest_of(name, "/nonexistent")
    assert manifests.generation_defaults(shipped) == {"temperature": 0.0}


@pytest.mark.parametrize("name", sorted(path.stem for path in SHIPPED_MANIFESTS.glob("*.json")))
def test_each_shipped_manifest_names_a_memory_and_options_it_takes(name):
    """A shipped manifest's mistakes would only be logged at startup: here they fail."""
    from engine.memories import check_options, memory_type
    from engine.models import manifest as manifests

    shipped = manifests.manifest_of(name, "/nonexistent")
    memory_type(manifests.default_memory(shipped))  # raises on a memory the server does not have
    assert manifests.memory_options(shipped), name
    for kind, options in manifests.memory_options(shipped).items():
        check_options(kind, options)  # raises on an option the memory refuses
    assert 0 < shipped["qa_accuracy"]["text"] <= shipped["qa_accuracy"]["oracle"] <= 1


def test_without_adapter_neurocache_is_refused(client):
    assert "neurocache" not in client.get("/v1/models").json()["data"][0]["memories"]
    response = client.post("/v1/sessions", json={"memory": "neurocache"})
    assert response.status_code == 400 and "adapter" in response.json()["error"]["message"]


def test_ingest_fills_the_cache_and_answers_use_it(make_client, adapter_dir):
    client = make_client(adapter_dir=[str(adapter_dir)])
    full = client.post("/v1/sessions", json={"memory": "neurocache"}).json()["id"]
    empty = client.post("/v1/sessions", json={"memory": "neurocache", "options": {"capacity": 512}}).json()["id"]
    doc = client.post(f"/v1/sessions/{full}/documents", json={"text": TEXT}).json()
    cache = client.get(f"/v1/sessions/{full}/cache").json()
    assert cache["entries"] == doc["tokens"] and cache["documents"] == 1
    assert client.get(f"/v1/sessions/{empty}/cache").json()["capacity"] == 512
    body = {"question": "Where did the rabbit go?", "max_tokens": 16, "temperature": 1.0, "seed": 0}
    with_doc = client.post(f"/v1/sessions/{full}/ask", json=body).json()
    without = client.post(f"/v1/sessions/{empty}/ask", json=body).json()
    assert with_doc["retrieval"]["memory"] == "neurocache"
    assert with_doc["usage"]["prompt_tokens"] == without["usage"]["prompt_tokens"]  # the question alone
    assert with_doc["answer"] != without["answer"]  # the cache changed what the model says
    again = client.post(f"/v1/sessions/{full}/ask", json=body).json()
    assert again["answer"] == with_doc["answer"]  # answering left the cache as it was
    assert client.get(f"/v1/sessions/{full}/cache").json() == cache
    streamed = client.post(f"/v1/sessions/{full}/ask", json={**body, "stream": True}).text
    assert "event: delta" in streamed and "event: done" in streamed


def test_failed_ingestion_rolls_the_cache_back(make_client, adapter_dir):
    client = make_client(adapter_dir=[str(adapter_dir)], max_document_tokens=3000)
    session = client.post("/v1/sessions", json={"memory": "neurocache"}).json()["id"]
    client.post(f"/v1/sessions/{session}/documents", json={"text": TEXT[:2000]})
    before = client.get(f"/v1/sessions/{session}/cache").json()
    engine = client.app.state.engine
    memory = engine.sessions.use(session).memory
    states = memory.cache.states.clone()
    fail_on_third_segment(memory)
    response = client.post(f"/v1/sessions/{session}/documents?stream=true", json={"text": TEXT})
    assert "event: error" in response.text and "internal_error" in response.text
    assert client.get(f"/v1/sessions/{session}/cache").json() == before
    assert torch.equal(memory.cache.states, states)


def test_remembered_turns_are_written_after_the_answer(make_client, adapter_dir):
    """With "remember", an answered turn's states (the prompt's and each fed answer token's) join
    the cache as a block of their own; without it the cache stays read-only (test above)."""
    client = make_client(adapter_dir=[str(adapter_dir)])
    session = client.post("/v1/sessions", json={"memory": "neurocache", "options": {"remember": True}}).json()["id"]
    doc = client.post(f"/v1/sessions/{session}/documents", json={"text": TEXT[:3000]}).json()
    body = {"question": "Where did the rabbit go?", "max_tokens": 6, "temperature": 1.0, "seed": 0}
    first = client.post(f"/v1/sessions/{session}/ask", json=body).json()
    cache = client.get(f"/v1/sessions/{session}/cache").json()
    fed = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"] - 1  # the last token is never fed
    assert cache["turns"] == 1 and cache["documents"] == 1
    assert cache["entries"] == doc["tokens"] + fed
    memory = client.app.state.engine.sessions.use(session).memory
    blocks = memory.cache.slot_document[: cache["entries"]]
    assert len(set(blocks[: doc["tokens"]].tolist())) == 1 and len(set(blocks[doc["tokens"] :].tolist())) == 1
    assert blocks[0] != blocks[-1]  # retrieval windows never run from the document into the turn
    client.post(f"/v1/sessions/{session}/ask", json={**body, "stream": True})
    assert client.get(f"/v1/sessions/{session}/cache").json()["turns"] == 2
    late = memory.binding()  # an answer still running when the cache is cleared writes nothing
    late.record.append(torch.zeros(1, 3, memory.cache.dim))
    epoch = memory.epoch
    assert client.delete(f"/v1/sessions/{session}/cache").json()["entries"] == 0
    memory.remember(late, epoch)
    assert memory.cache.size == 0 and memory.stats().turns == 0


def test_a_remembered_chat_turn_leaves_out_the_earlier_turns_sent_along(make_client, adapter_dir, tiny_tokenizer):
    """OpenAI-style chat sends the whole conversation each time; only the new turn is written."""
    client = make_client(adapter_dir=[str(adapter_dir)])
    session = client.post("/v1/sessions", json={"memory": "neurocache", "options": {"remember": True}}).json()["id"]
    history = [{"role": "user", "content": "Who went down the rabbit-hole?"}, {"role": "assistant", "content": "Alice did."}]
    messages = [*history, {"role": "user", "content": "And then?"}]
    body = {"messages": messages, "session_id": session, "max_tokens": 5, "temperature": 1.0, "seed": 0}
    usage = client.post("/v1/chat/completions", json=body).json()["usage"]
    rendered = tiny_tokenizer.apply_chat_template(history, add_generation_prompt=False, tokenize=False)
    earlier = len(tiny_tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert 0 < earlier < usage["prompt_tokens"]
    cache = client.get(f"/v1/sessions/{session}/cache").json()
    assert cache["turns"] == 1
    assert cache["entries"] == usage["prompt_tokens"] - earlier + usage["completion_tokens"] - 1


def test_history_tokens_counts_only_a_rendered_prefix(tiny_tokenizer):
    from engine.prompts import history_tokens, render

    history = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Hi."}]
    prompt = render(tiny_tokenizer, [*history, {"role": "user", "content": "Again?"}])
    count = history_tokens(tiny_tokenizer, history, prompt)
    assert 0 < count < len(prompt)
    assert history_tokens(tiny_tokenizer, [], prompt) == 0
    other = render(tiny_tokenizer, [{"role": "user", "content": "Something else entirely."}])
    assert history_tokens(tiny_tokenizer, history, other) == 0  # not a prefix: keep the whole turn


def test_remember_must_be_a_boolean(make_client, adapter_dir):
    client = make_client(adapter_dir=[str(adapter_dir)])
    response = client.post("/v1/sessions", json={"memory": "neurocache", "options": {"remember": "yes"}})
    assert response.status_code == 400 and "remember: Input should be a valid boolean" in response.json()["error"]["message"]


def test_a_full_cache_says_what_it_dropped(make_client, adapter_dir):
    client = make_client(adapter_dir=[str(adapter_dir)])
    small = client.post("/v1/sessions", json={"memory": "neurocache", "options": {"capacity": 512}}).json()["id"]
    doc = client.post(f"/v1/sessions/{small}/documents", json={"text": TEXT}).json()
    assert doc["tokens"] > 512 and "512" in doc["warning"]
    cache = client.get(f"/v1/sessions/{small}/cache").json()
    assert cache["entries"] == 512 and cache["dropped_tokens"] == doc["tokens"] - 512
