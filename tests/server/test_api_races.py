"""Requests that race on one session, each with a defined result:

- clear during ingestion: 409; the ingestion completes; clearing afterwards works;
- delete during ingestion: the delete wins; the ingestion stops with 404 and gives its bytes back;
- delete during an answer: the answer completes from what it had; the session is gone afterwards;
- two answers at once on one session: both complete, each as it would alone;
- clear during a remembered answer: the clear wins; the answer's turn is not written.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.engine.test_cpu_kernels import BUILDABLE
from tests.helpers import (
    DOCUMENT,
    TEST_DEVICE,
    TIMEOUT,
    Hold,
    assert_error,
    in_thread,
    ingest_held,
    make_tiny_llama,
    new_session,
    session_of,
)


def each_step(client):
    """A module every decoding step runs once, batched or not: the model's output layer."""
    return client.app.state.engine.models.runtimes()[0].loaded.model.lm_head


def test_clear_during_ingestion_is_409_and_the_document_lands(make_client):
    client = make_client()
    session_id = new_session(client, memory="text")
    hold, thread, result = ingest_held(client, session_id)
    assert_error(client.delete(f"/v1/sessions/{session_id}/cache"), 409, "conflict")
    hold.released.set()
    thread.join(TIMEOUT)
    assert result[0].status_code == 201
    assert client.get(f"/v1/sessions/{session_id}/cache").json()["documents"] == 1
    assert client.delete(f"/v1/sessions/{session_id}/cache").json()["documents"] == 0


def test_delete_during_ingestion_stops_it_and_frees_its_bytes(make_client):
    client = make_client()
    engine = client.app.state.engine
    session_id = new_session(client, memory="text")
    memory = session_of(client, session_id).memory
    hold, thread, result = ingest_held(client, session_id)
    assert engine.sessions.reserved_bytes > 0
    assert client.delete(f"/v1/sessions/{session_id}").status_code == 204
    hold.released.set()
    thread.join(TIMEOUT)
    assert "deleted during ingestion" in assert_error(result[0], 404, "not_found")["message"]
    assert engine.sessions.reserved_bytes == 0 and engine.sessions.used_bytes() == 0
    assert memory.stats().documents == 0  # the staged document was dropped, not committed
    assert_error(client.get(f"/v1/sessions/{session_id}"), 404)


def test_delete_during_an_answer_lets_it_finish(make_client):
    client = make_client()
    session_id = new_session(client, memory="text")
    client.post(f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT})
    body = {"question": "What colour is the lighthouse?", "max_tokens": 8}
    alone = client.post(f"/v1/sessions/{session_id}/ask", json=body).json()
    hold = Hold(after=3)
    handle = each_step(client).register_forward_pre_hook(hold.hook)
    try:
        thread, result = in_thread(lambda: client.post(f"/v1/sessions/{session_id}/ask", json=body))
        assert hold.reached.wait(TIMEOUT)
        assert client.delete(f"/v1/sessions/{session_id}").status_code == 204
        hold.released.set()
        thread.join(TIMEOUT)
    finally:
        handle.remove()
    assert result[0].status_code == 200
    assert result[0].json()["answer"] == alone["answer"]
    assert_error(client.post(f"/v1/sessions/{session_id}/ask", json=body), 404)


def test_two_answers_at_once_on_one_session(make_client):
    client = make_client()
    session_id = new_session(client, memory="text")
    client.post(f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT})
    body = {"question": "What colour is the lighthouse?", "max_tokens": 12}
    alone = client.post(f"/v1/sessions/{session_id}/ask", json=body).json()["answer"]
    threads = [in_thread(lambda: client.post(f"/v1/sessions/{session_id}/ask", json=body)) for _ in range(2)]
    for thread, _ in threads:
        thread.join(TIMEOUT)
    assert [result[0].json()["answer"] for _, result in threads] == [alone, alone]


def test_clear_during_a_remembered_answer_drops_the_turn(make_client, adapter_dir):  # noqa: F811
    client = make_client(adapter_dir=[str(adapter_dir)])
    session_id = client.post("/v1/sessions", json={"memory": "neurocache", "options": {"remember": True}}).json()["id"]
    client.post(f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT})
    body = {"question": "What colour is the lighthouse?", "max_tokens": 8}
    client.post(f"/v1/sessions/{session_id}/ask", json=body)
    assert client.get(f"/v1/sessions/{session_id}/cache").json()["turns"] == 1  # remembered when nothing races
    hold = Hold(after=3)
    handle = each_step(client).register_forward_pre_hook(hold.hook)
    try:
        thread, result = in_thread(lambda: client.post(f"/v1/sessions/{session_id}/ask", json=body))
        assert hold.reached.wait(TIMEOUT)
        # the clear runs on the model's worker, between two decoding steps of the answer
        clearing, cleared = in_thread(lambda: client.delete(f"/v1/sessions/{session_id}/cache"))
        queue = client.app.state.engine.models.runtimes()[0].worker._executor._work_queue
        deadline = time.monotonic() + TIMEOUT
        while queue.qsize() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        hold.released.set()
        thread.join(TIMEOUT)
        clearing.join(TIMEOUT)
    finally:
        handle.remove()
    assert cleared[0].status_code == 200 and cleared[0].json()["entries"] == 0
    assert result[0].status_code == 200
    cache = client.get(f"/v1/sessions/{session_id}/cache").json()
    assert cache["entries"] == 0 and cache["turns"] == 0 and cache["documents"] == 0


@pytest.mark.parametrize("memory", ["text", "truncate"])
def test_budget_accounting_returns_to_zero_after_everything(make_client, memory):
    client = make_client()
    engine = client.app.state.engine
    session_id = new_session(client, memory=memory)
    client.post(f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT})
    held = client.get(f"/v1/sessions/{session_id}/cache").json()["bytes"]
    assert engine.sessions.used_bytes() == held > 0 and engine.sessions.reserved_bytes == 0
    client.delete(f"/v1/sessions/{session_id}")
    assert engine.sessions.used_bytes() == 0


@pytest.mark.skipif(TEST_DEVICE != "cpu" or not BUILDABLE, reason="the C step is for CPU, where its kernels build")
def test_a_bfloat16_models_answers_reserve_the_float32_keys_its_c_step_keeps(make_client, tiny_dir, tmp_path):
    folder = make_tiny_llama(tmp_path / "c-step-tiny", tiny_dir, hidden_size=64, intermediate_size=96)  # head_dim 16
    client = make_client(model=[str(folder)], dtype="bfloat16")
    runtime = client.app.state.engine.models.runtimes()[0]
    loaded = runtime.loaded
    assert runtime.batcher is not None and runtime.batcher._decoder.native is not None  # answers step in C
    config = loaded.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    float32_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    assert loaded.dtype == torch.bfloat16 and loaded.kv_bytes_per_token == float32_bytes
    session_id = new_session(client, memory="text")
    client.post(f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT})
    answer = client.post(f"/v1/sessions/{session_id}/ask", json={"question": "q", "max_tokens": 8})
    assert answer.status_code == 200 and answer.json()["answer"]


def test_an_answers_key_value_cache_is_held_in_blocks_while_it_runs(make_client):
    client = make_client()
    engine = client.app.state.engine
    loaded = engine.models.runtimes()[0].loaded
    session_id = new_session(client, memory="text")
    client.post(f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT})
    hold = Hold(after=3)
    handle = each_step(client).register_forward_pre_hook(hold.hook)
    try:
        thread, result = in_thread(lambda: client.post(f"/v1/sessions/{session_id}/ask", json={"question": "q", "max_tokens": 8}))
        assert hold.reached.wait(TIMEOUT)
        batcher = engine.models.runtimes()[0].batcher
        kv, kept = batcher.kv, batcher.prefix.nbytes  # its prompt's keys and values, kept for the session's next
        held = engine.sessions.reserved_bytes - kept  # the blocks its prompt and first tokens fill, not the whole context
        assert held == kv.in_use * kv.block_tokens * loaded.kv_bytes_per_token > 0 and kept > 0
        assert held < loaded.context_len * loaded.kv_bytes_per_token
        metrics = client.get("/metrics").text
        assert f'longdoc_batch_rows{{model="{loaded.name}"}} 1.0' in metrics  # the answer is in the batch
        assert f'longdoc_kv_blocks{{model="{loaded.name}"}} {kv.in_use}.0' in metrics
        hold.released.set()
        thread.join(TIMEOUT)
    finally:
        handle.remove()
    assert result[0].status_code == 200 and engine.sessions.reserved_bytes == kept
    metrics = client.get("/metrics").text
    assert f'longdoc_batch_rows{{model="{loaded.name}"}} 0.0' in metrics
    assert f'longdoc_kv_blocks{{model="{loaded.name}"}} 0.0' in metrics
    assert f'longdoc_prefix_cache_tokens{{model="{loaded.name}"}} {batcher.prefix.tokens}.0' in metrics
    client.delete(f"/v1/sessions/{session_id}")  # its kept prompt goes with it
    assert engine.sessions.reserved_bytes == 0 and batcher.prefix.tokens == 0


def test_answers_that_cannot_fit_the_server_budget_are_refused(make_client):
    """An answer holds what its prompt and tokens fill, not its whole context: on a budget under one
    full-context cache a session's short answer is served, and one whose max_tokens alone could
    never fit gets 413."""
    per_token = make_client().app.state.engine.models.runtimes()[0].loaded.kv_bytes_per_token
    client = make_client(max_memory_bytes=300 * per_token)
    loaded = client.app.state.engine.models.runtimes()[0].loaded
    assert loaded.context_len > 1024  # a full-context cache would not fit
    session_id = new_session(client, memory="text")
    assert client.post(f"/v1/sessions/{session_id}/ask", json={"question": "q", "max_tokens": 8}).status_code == 200
    too_many = 400
    ask = {"question": "q", "max_tokens": too_many}
    error = assert_error(client.post(f"/v1/sessions/{session_id}/ask", json=ask), 413, "too_large")
    assert "LONGDOC_MAX_MEMORY_BYTES" in error["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": too_many}
    assert_error(client.post("/v1/chat/completions", json=chat), 413, "too_large")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200  # a short chat's cache fits
