"""Two servers sharing one data folder (replicas behind a session-affine router): each finds the
other's sessions on disk, reads a session again when the other has changed it, forgets one the
other deleted, and never drops a session on disk that the other is using."""

from __future__ import annotations

import os
import time
from dataclasses import replace

from fastapi.testclient import TestClient

from engine.engine import Engine
from server.app import create_app
from tests.helpers import new_session, tiny_settings, wait_ready

DOCUMENT = "The lighthouse of Velmora is painted violet. " * 40
SECOND = "The harbour master of Velmora is called Odile Brandt. " * 20
THIRD = "The ferry to Velmora leaves at seven. " * 20
QUESTION = {"question": "What colour is the lighthouse?", "max_tokens": 8}


def two_servers(make_client, tmp_path, **overrides):
    settings = dict(data_dir=tmp_path / "sessions", shared_data_dir=True, **overrides)
    return make_client(**settings), make_client(**settings)


def test_a_session_moves_between_servers_with_nothing_lost(make_client, tmp_path):
    a, b = two_servers(make_client, tmp_path)
    session_id = new_session(a, memory="text")
    first = a.post(f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT}).json()
    answer_a = a.post(f"/v1/sessions/{session_id}/ask", json=QUESTION).json()

    # b never saw this session: it is found on disk, and answers as a did
    answer_b = b.post(f"/v1/sessions/{session_id}/ask", json=QUESTION).json()
    assert answer_b["answer"] == answer_a["answer"]
    assert answer_b["retrieval"]["items"] == answer_a["retrieval"]["items"]
    second = b.post(f"/v1/sessions/{session_id}/documents", json={"text": SECOND}).json()

    # a's copy in RAM is older than disk now: it is read again, with both documents
    info = a.get(f"/v1/sessions/{session_id}").json()
    assert info["documents"] == [first, second] and info["resident"] is False
    assert a.get(f"/v1/sessions/{session_id}/cache").json() == b.get(f"/v1/sessions/{session_id}/cache").json()
    asked = a.post(f"/v1/sessions/{session_id}/ask", json={**QUESTION, "question": "Who is the harbour master?"}).json()
    assert second["id"] in {item["document_id"] for item in asked["retrieval"]["items"]}

    assert b.delete(f"/v1/sessions/{session_id}").status_code == 204
    assert a.get(f"/v1/sessions/{session_id}").status_code == 404
    assert session_id not in [s["id"] for s in a.get("/v1/sessions").json()["data"]]


def test_a_change_from_a_stale_copy_is_refused_not_saved_over_another(make_client, tmp_path):
    """Two replicas both used a session during an owner change: the one whose copy is older than
    disk is refused (409), and the document the other committed stays."""
    a, b = two_servers(make_client, tmp_path)
    session_id = new_session(a, memory="text")
    first = a.post(f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT}).json()
    assert b.post(f"/v1/sessions/{session_id}/ask", json=QUESTION).status_code == 200  # b holds it in RAM too
    held = b.app.state.engine.sessions.peek(session_id)
    held.requests_in_flight += 1  # a request of b's is under way: b cannot read the session again now
    held.dirty = True  # and an earlier save of b's failed
    second = a.post(f"/v1/sessions/{session_id}/documents", json={"text": SECOND}).json()

    refused = b.post(f"/v1/sessions/{session_id}/documents", json={"text": THIRD})
    assert refused.status_code == 409 and "another replica" in refused.json()["error"]["message"]
    held.requests_in_flight -= 1
    for server in (a, b):  # b reads it again from disk: a's documents, not b's
        assert server.get(f"/v1/sessions/{session_id}").json()["documents"] == [first, second]
    third = b.post(f"/v1/sessions/{session_id}/documents", json={"text": THIRD}).json()  # sent again, saved
    assert a.get(f"/v1/sessions/{session_id}").json()["documents"] == [first, second, third]


def test_max_sessions_counts_every_server_on_the_folder(make_client, tmp_path):
    a, b = two_servers(make_client, tmp_path, max_sessions=2)
    new_session(a, memory="text")
    new_session(b, memory="text")
    refused = a.post("/v1/sessions", json={"memory": "text"})  # a holds one, the folder two
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "too_many_sessions"


def test_each_server_lists_every_session_on_disk(make_client, tmp_path):
    a, b = two_servers(make_client, tmp_path)
    made = {new_session(a, memory="text"), new_session(b, memory="truncate")}
    for server in (a, b):
        assert {s["id"] for s in server.get("/v1/sessions").json()["data"]} == made


def test_a_session_used_elsewhere_is_not_dropped_for_age(make_client, tmp_path):
    a, b = two_servers(make_client, tmp_path, saved_session_ttl_seconds=100.0)
    session_id = new_session(a, memory="text")
    b.get("/v1/sessions")  # b lists it from disk, not resident there
    held = b.app.state.engine.sessions.peek(session_id)
    held.last_used_at = time.time() - 1000  # b has not used it for ten TTLs ...
    b.app.state.engine.sessions.evict_idle()
    assert (tmp_path / "sessions" / session_id).is_dir()  # ... but a wrote it just now: kept
    assert b.get(f"/v1/sessions/{session_id}").status_code == 200

    folder = tmp_path / "sessions" / session_id
    old = time.time() - 1000

    def age() -> None:
        for path in folder.iterdir():
            os.utime(path, (old, old))
        b.app.state.engine.sessions.peek(session_id).last_used_at = old

    age()
    assert a.get(f"/v1/sessions/{session_id}/cache").status_code == 200  # a reads it, writes nothing
    b.app.state.engine.sessions.evict_idle()
    assert folder.is_dir()  # a's use was recorded on disk: kept
    age()
    b.app.state.engine.sessions.evict_idle()  # no server has written or used it within the TTL
    assert not folder.exists()


def test_new_session_ids_carry_the_prefix(tiny_dir, tmp_path):
    settings = tiny_settings(tiny_dir, data_dir=tmp_path / "sessions", shared_data_dir=True)
    app = create_app(settings, lambda s: Engine(replace(s.engine_config(), session_id_prefix="s-r1x-")))
    with TestClient(app) as client:
        wait_ready(client)
        assert new_session(client, memory="text").startswith("s-r1x-")


def test_an_unreadable_snapshot_is_counted_once(make_client, tmp_path):
    a, _ = two_servers(make_client, tmp_path)
    folder = tmp_path / "sessions" / "unreadable-0"
    folder.mkdir(parents=True)
    (folder / "session.json").write_text('{"format": "longdoc-session-v0"}')
    for _ in range(3):
        assert a.get("/v1/sessions").status_code == 200
    assert a.app.state.engine.session_service.snapshot_failures == 1
