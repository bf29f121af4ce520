"""Sessions belong to the API key that made them; the admin key sees every session."""

from __future__ import annotations

import logging

import pytest

from tests.helpers import assert_error

ALICE, BOB, ADMIN = "alice-secret-1", "bob-secret-2", "admin-secret-3"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def keyed(make_client, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"# name:key a line\nalice:{ALICE}\n\n{BOB}   # a bare key\n")
    return make_client(api_keys_file=str(keys), admin_key=ADMIN)


def test_sessions_are_visible_only_to_their_key(keyed, caplog):
    caplog.set_level(logging.DEBUG)
    made = keyed.post("/v1/sessions", json={"memory": "text"}, headers=auth(ALICE)).json()
    assert made["owner"] == "alice"
    session_id = made["id"]
    url = f"/v1/sessions/{session_id}"
    document = keyed.post(f"{url}/documents", json={"text": "The lighthouse is violet."}, headers=auth(ALICE)).json()
    as_bob = auth(BOB)
    for method, path, body in [
        ("GET", url, None),
        ("DELETE", url, None),
        ("GET", f"{url}/documents", None),
        ("GET", f"{url}/documents/{document['id']}", None),
        ("POST", f"{url}/documents", {"text": "intruder"}),
        ("POST", f"{url}/ask", {"question": "What colour?", "max_tokens": 2}),
        ("GET", f"{url}/cache", None),
        ("DELETE", f"{url}/cache", None),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "session_id": session_id}),
    ]:
        error = assert_error(keyed.request(method, path, json=body, headers=as_bob), 404, "not_found")
        assert session_id in error["message"] or "no session" in error["message"]
    assert keyed.get("/v1/sessions", headers=as_bob).json()["data"] == []
    bobs = keyed.post("/v1/sessions", json={"memory": "text"}, headers=as_bob).json()
    assert bobs["owner"].startswith("key-") and BOB not in bobs["owner"]
    # alice's session is as it was; the admin sees both and may act on either
    assert [d["id"] for d in keyed.get(f"{url}/documents", headers=auth(ALICE)).json()["data"]] == [document["id"]]
    assert [s["id"] for s in keyed.get("/v1/sessions", headers=auth(ALICE)).json()["data"]] == [session_id]
    assert {s["id"] for s in keyed.get("/v1/sessions", headers=auth(ADMIN)).json()["data"]} == {session_id, bobs["id"]}
    assert keyed.get(url, headers=auth(ADMIN)).status_code == 200
    assert keyed.delete(url, headers=auth(ADMIN)).status_code == 204
    logged = caplog.text
    assert all(key not in logged for key in (ALICE, BOB, ADMIN))


def test_unknown_keys_and_no_keys(keyed, client):
    assert_error(keyed.get("/v1/sessions", headers=auth("nobody")), 401, "unauthorized")
    assert_error(keyed.get("/v1/sessions"), 401)
    # without keys every session is everyone's, as before
    session_id = client.post("/v1/sessions", json={"memory": "text"}).json()["id"]
    assert [s["id"] for s in client.get("/v1/sessions").json()["data"]] == [session_id]


def test_keys_file_errors_are_refused_at_start(tmp_path):
    from server.auth import KeyRing, read_keys_file

    duplicate = tmp_path / "keys"
    duplicate.write_text("a:one\nb:one\n")
    with pytest.raises(ValueError, match="configured twice"):
        KeyRing(read_keys_file(duplicate))
    empty = tmp_path / "empty"
    empty.write_text("a:\n")
    with pytest.raises(ValueError, match="empty key"):
        read_keys_file(empty)
