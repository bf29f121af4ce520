"""Every error status the API promises, each as JSON {"error": {"type", "message"}}."""

from __future__ import annotations

import asyncio
import threading

from fastapi.testclient import TestClient

from engine.engine import Engine
from server.app import create_app
from tests.helpers import assert_error, new_session, tiny_settings, wait_ready


def test_400_bad_requests(shared_client):
    assert_error(shared_client.post("/v1/sessions", json={"memory": "nope"}), 400, "invalid_request")
    assert_error(shared_client.post("/v1/sessions", json={"memory": "text", "options": {"top_k": 0}}), 400)
    session_id = new_session(shared_client)
    too_long = {"question": "q", "max_tokens": 100_000}
    assert_error(shared_client.post(f"/v1/sessions/{session_id}/ask", json=too_long), 400, "invalid_request")
    last_not_user = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    assert_error(shared_client.post("/v1/chat/completions", json=last_not_user), 400)
    huge_prompt = {"messages": [{"role": "user", "content": "word " * 5000}], "max_tokens": 10}
    assert "context" in assert_error(shared_client.post("/v1/chat/completions", json=huge_prompt), 400)["message"]
    empty = shared_client.post(f"/v1/sessions/{session_id}/documents", content="   ", headers={"content-type": "text/plain"})
    assert_error(empty, 400)


def test_422_malformed(shared_client):
    session_id = new_session(shared_client)
    assert_error(shared_client.post("/v1/sessions", content="{not json", headers={"content-type": "application/json"}), 422)
    assert_error(shared_client.post(f"/v1/sessions/{session_id}/ask", json={"max_tokens": 3}), 422, "validation_error")
    assert_error(shared_client.post(f"/v1/sessions/{session_id}/ask", json={"question": "q", "temperature": -1}), 422)
    assert_error(shared_client.post(f"/v1/sessions/{session_id}/documents", json={"name": "no text"}), 422)
    assert_error(
        shared_client.post(f"/v1/sessions/{session_id}/documents", content=b"{", headers={"content-type": "application/json"}),
        422,
    )
    two = {"messages": [{"role": "user", "content": "a"}], "n": 2}
    assert_error(shared_client.post("/v1/chat/completions", json=two), 422)


def test_404_unknown_things(shared_client):
    assert_error(shared_client.get("/v1/sessions/s-missing"), 404, "not_found")
    assert_error(shared_client.delete("/v1/sessions/s-missing"), 404)
    assert_error(shared_client.post("/v1/sessions/s-missing/ask", json={"question": "q"}), 404)
    assert_error(shared_client.post("/v1/sessions/s-missing/documents", json={"text": "t"}), 404)
    assert_error(shared_client.get("/v1/sessions/s-missing/cache"), 404)
    session_id = new_session(shared_client)
    assert_error(shared_client.get(f"/v1/sessions/{session_id}/documents/d-missing"), 404)
    assert_error(shared_client.post("/v1/sessions", json={"model": "no-such-model"}), 404)
    chat = {"messages": [{"role": "user", "content": "hi"}], "session_id": "s-missing"}
    assert_error(shared_client.post("/v1/chat/completions", json=chat), 404)
    assert_error(shared_client.get("/v1/nothing-here"), 404)


def test_413_document_too_large(make_client):
    client = make_client(max_document_bytes=2000)
    session_id = new_session(client)
    url = f"/v1/sessions/{session_id}/documents"
    big = "x" * 3000
    assert_error(client.post(url, json={"text": big}), 413, "too_large")
    assert_error(client.post(url, content=big, headers={"content-type": "text/plain"}), 413)
    assert_error(client.post(url, files={"file": ("big.txt", big.encode(), "text/plain")}), 413)
    assert client.post(url, json={"text": "small enough"}).status_code == 201


def test_415_media_type_and_bad_bytes(shared_client):
    session_id = new_session(shared_client)
    url = f"/v1/sessions/{session_id}/documents"
    assert_error(
        shared_client.post(url, content="<a/>", headers={"content-type": "application/xml"}), 415, "unsupported_media_type"
    )
    latin1 = "café".encode("latin-1")
    assert_error(shared_client.post(url, content=latin1, headers={"content-type": "text/plain"}), 415)
    assert_error(shared_client.post(url, files={"file": ("bad.txt", b"\xff\xfe\xfa", "text/plain")}), 415)
    assert shared_client.get(f"/v1/sessions/{session_id}").json()["documents"] == []


def test_401_api_key(make_client):
    client = make_client(api_key="sekret-key")
    assert_error(client.get("/v1/sessions"), 401, "unauthorized")
    assert_error(client.get("/v1/sessions", headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(client.get("/v1/models", headers={"Authorization": "sekret-key"}), 401)
    assert client.get("/v1/sessions", headers={"Authorization": "Bearer sekret-key"}).status_code == 200
    assert client.get("/healthz").status_code == 200 and client.get("/metrics").status_code == 200


def test_429_queue_full_with_retry_after(make_client):
    client = make_client(max_queue=1)
    engine = client.app.state.engine
    runtime = engine.models.runtimes()[0]
    held = runtime.worker.admit()  # the one admitted request, still in flight
    try:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        response = client.post("/v1/chat/completions", json=chat)
        assert_error(response, 429, "queue_full")
        assert int(response.headers["Retry-After"]) >= 1
    finally:
        held.release()
    assert client.post("/v1/chat/completions", json=chat).status_code == 200


def test_memory_budget_refusals_keep_earlier_documents(make_client):
    client = make_client(session_memory_bytes=170_000)
    session_id = new_session(client, memory="text")
    url = f"/v1/sessions/{session_id}/documents"
    kept = client.post(url, json={"text": "word " * 1000}).json()
    cache_before = client.get(f"/v1/sessions/{session_id}/cache").json()
    # alone over the session's budget: no retry can succeed
    assert (
        "LONGDOC_SESSION_MEMORY_BYTES"
        in assert_error(client.post(url, json={"text": "Far too long. " * 2000}), 413, "too_large")["message"]
    )
    # fits an empty session, not this one now: 429, until the cache is cleared
    response = client.post(url, json={"text": "word " * 1000})
    assert "clear its cache" in assert_error(response, 429, "memory_budget_exceeded")["message"]
    assert int(response.headers["Retry-After"]) >= 1
    assert [d["id"] for d in client.get(url).json()["data"]] == [kept["id"]]
    assert client.get(f"/v1/sessions/{session_id}/cache").json() == cache_before
    client.delete(f"/v1/sessions/{session_id}/cache")
    assert client.post(url, json={"text": "word " * 1000}).status_code == 201


def test_429_budget_exceeded_mid_stream_is_an_error_event(make_client):
    # text memory's upfront estimate passes; the exact count while ingesting does not
    client = make_client(session_memory_bytes=5_000_000)
    session_id = new_session(client, memory="text", options={"chunk_tokens": 16, "max_chunks": 3})
    response = client.post(f"/v1/sessions/{session_id}/documents?stream=true", json={"text": "word " * 400})
    assert response.status_code == 200
    assert '"memory_budget_exceeded"' in response.text and "event: error" in response.text
    assert client.get(f"/v1/sessions/{session_id}/cache").json()["entries"] == 0


def test_429_too_many_sessions(make_client):
    client = make_client(max_sessions=1)
    new_session(client)
    assert_error(client.post("/v1/sessions", json={}), 429, "too_many_sessions")


def test_503_while_loading(tiny_dir):
    release = threading.Event()

    class SlowEngine(Engine):
        async def start(self) -> None:
            await asyncio.to_thread(release.wait, 60)
            await super().start()

    app = create_app(tiny_settings(tiny_dir), engine_factory=lambda s: SlowEngine(s.engine_config()))
    with TestClient(app) as client:
        assert client.get("/healthz").status_code == 200
        response = client.get("/readyz")
        assert_error(response, 503, "not_ready")
        assert_error(client.post("/v1/sessions", json={}), 503, "not_ready")
        assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}), 503)
        release.set()
        wait_ready(client)
        assert client.post("/v1/sessions", json={}).status_code == 201


def test_internal_errors_do_not_leak(make_client, monkeypatch):
    client = make_client()
    engine = client.app.state.engine

    def broken(*args, **kwargs):
        raise RuntimeError("secret internals /path/to/thing")

    monkeypatch.setattr(engine, "list_sessions", broken)
    response = TestClient(client.app, raise_server_exceptions=False).get("/v1/sessions")
    error = assert_error(response, 500, "internal_error")
    assert "secret" not in error["message"]
