"""Sessions saved on disk: snapshots round-trip, survive restarts of the app, are loaded lazily,
leave RAM when idle, and a bad snapshot is skipped without harm."""

from __future__ import annotations

import json
import math
import shutil
import time
from typing import Any

import numpy as np
import pytest
import torch

from engine.memories.text.options import TextOptions
from engine.sessions.snapshots import Snapshot, SnapshotError, SnapshotStore, StaleSnapshotError, pack, unpack
from tests.helpers import ingest_held, new_session, session_of

DOCUMENT = "The lighthouse of Velmora is painted violet. " * 40
QUESTION = {"question": "What colour is the lighthouse?", "max_tokens": 8}


def test_pack_round_trips_nested_states():
    state: dict[str, Any] = {
        "ids": [np.arange(3, dtype=np.int32), np.zeros((0, 2), np.int64)],
        "t": torch.ones(2, 3, dtype=torch.bfloat16),
        "n": 7,
        "f": 0.5,
        "s": ["a", "b"],
        "none": None,
        "deep": {"x": {"y": torch.tensor([1])}},
    }
    tensors: dict = {}
    back = unpack(json.loads(json.dumps(pack(state, tensors))), tensors)
    assert back["n"] == 7 and back["f"] == 0.5 and back["s"] == ["a", "b"] and back["none"] is None
    np.testing.assert_array_equal(back["ids"][0], state["ids"][0])
    assert back["ids"][1].shape == (0, 2) and back["t"].dtype == torch.bfloat16 and back["deep"]["x"]["y"].tolist() == [1]


def test_snapshots_replace_each_other_and_bad_ones_are_refused(tmp_path):
    store = SnapshotStore(tmp_path)
    for generation in range(3):
        store.write(Snapshot({"id": "s-1", "n": generation}, {"v": torch.full((4,), float(generation))}))
    assert store.list() == ["s-1"]
    snapshot = store.read("s-1")
    assert snapshot.session["n"] == 2 and snapshot.state["v"].tolist() == [2.0] * 4
    assert [p.name for p in (tmp_path / "s-1").glob("state-*")] == ["state-3.safetensors"]  # older ones removed
    (tmp_path / "s-1" / ".state-4.safetensors.tmp").write_bytes(b"half written")  # a crash mid-write
    assert store.read("s-1").session["n"] == 2
    tensors = tmp_path / "s-1" / "state-3.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-1] + b"\x00")
    with pytest.raises(SnapshotError, match="checksum"):
        store.read("s-1")
    manifest = tmp_path / "s-1" / "session.json"
    manifest.write_text(manifest.read_text().replace("longdoc-session-v1", "longdoc-session-v0"))
    with pytest.raises(SnapshotError, match="not a longdoc-session-v1"):
        store.read_session("s-1")
    with pytest.raises(ValueError):
        store.folder("../etc")


def test_a_write_from_a_stale_generation_is_refused(tmp_path):
    store = SnapshotStore(tmp_path)

    def snapshot(n: int) -> Snapshot:
        return Snapshot({"id": "s-1", "n": n}, {"v": torch.full((4,), float(n))})

    assert store.write(snapshot(1), expected=0) == 1
    assert store.write(snapshot(2), expected=1) == 2
    with pytest.raises(StaleSnapshotError):
        store.write(snapshot(3), expected=1)  # read at 1, but 2 was written since
    with pytest.raises(StaleSnapshotError):
        store.write(snapshot(3), expected=0)  # a new session whose id is taken
    assert store.read("s-1").session["n"] == 2 and store.read("s-1").generation == 2
    assert store.delete("s-1", expected=1) is False  # a drop for age, decided on generation 1
    assert store.read("s-1").generation == 2
    assert store.delete("s-1") is True
    with pytest.raises(StaleSnapshotError):
        store.write(snapshot(3), expected=2)  # deleted since: not brought back
    assert store.list() == [] and list(tmp_path.iterdir()) == []  # nothing left behind


def test_a_failure_after_the_manifest_is_in_place_does_not_undo_the_write(tmp_path, monkeypatch):
    from engine.sessions import snapshots as persistence

    store = SnapshotStore(tmp_path)
    real = persistence._fsync

    def failing_on_the_folder(path):
        if path == tmp_path / "s-1":
            raise OSError("fsync failed")
        real(path)

    monkeypatch.setattr(persistence, "_fsync", failing_on_the_folder)
    assert store.write(Snapshot({"id": "s-1"}, {"v": torch.ones(2)}), expected=0) == 1
    assert store.write(Snapshot({"id": "s-1"}, {"v": torch.ones(2)}), expected=1) == 2  # the generation held


def test_writers_racing_on_one_session_commit_one_at_a_time(tmp_path):
    """Eight servers' writes of one session at once (each its own store on the shared folder):
    the ones that read the same generation, exactly one wins; the snapshot left is whole."""
    from concurrent.futures import ThreadPoolExecutor

    SnapshotStore(tmp_path).write(Snapshot({"id": "s-1", "n": 0}, {"v": torch.zeros(1 << 16)}), expected=0)

    def write(n: int) -> bool:
        try:
            SnapshotStore(tmp_path).write(Snapshot({"id": "s-1", "n": n}, {"v": torch.full((1 << 16,), float(n))}), expected=1)
        except StaleSnapshotError:
            return False
        return True

    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(write, range(1, 9)))
    assert sum(won) == 1
    snapshot = SnapshotStore(tmp_path).read("s-1")
    winner = won.index(True) + 1
    assert snapshot.generation == 2 and snapshot.session["n"] == winner
    assert snapshot.state["v"].eq(float(winner)).all()
    assert not list((tmp_path / "s-1").glob(".*.tmp"))


KVCACHE_SIZES = {"segment_len": 16, "neighbours": 3, "window": 64, "sinks": 8}  # segments to pick in DOCUMENT
KVCACHE_TEXT = {**KVCACHE_SIZES, "selection": "text", "top_k": 2}
KVCACHE_SUMMARY = {**KVCACHE_SIZES, "selection": "summary", "top_k": 2}


@pytest.mark.parametrize(
    ("memory", "options"),
    [
        ("text", None),
        ("truncate", None),
        ("neurocache", None),
        ("kvcache", None),
        ("kvcache", KVCACHE_SUMMARY),
        ("kvcache", KVCACHE_TEXT),
    ],
)
def test_sessions_come_back_after_a_restart(make_client, tmp_path, adapter_dir, memory, options):  # noqa: F811
    settings = dict(data_dir=tmp_path / "sessions", adapter_dir=[str(adapter_dir)])
    client = make_client(**settings)
    session_id = new_session(client, memory=memory, **({"options": options} if options else {}))
    document = client.post(f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT}).json()
    before = client.post(f"/v1/sessions/{session_id}/ask", json=QUESTION).json()
    cache = client.get(f"/v1/sessions/{session_id}/cache").json()
    client.__exit__(None, None, None)  # the server stops

    restarted = make_client(**settings)
    info = restarted.get(f"/v1/sessions/{session_id}").json()
    assert info["resident"] is False and info["documents"] == [document] and info["cache"] == cache
    assert restarted.app.state.engine.sessions.used_bytes() == 0  # nothing loaded yet
    after = restarted.post(f"/v1/sessions/{session_id}/ask", json=QUESTION).json()
    assert after["answer"] == before["answer"] and after["retrieval"]["items"] == before["retrieval"]["items"]
    assert restarted.get(f"/v1/sessions/{session_id}").json()["resident"] is True
    assert restarted.get(f"/v1/sessions/{session_id}/cache").json() == cache


def test_a_kvcache_session_saved_before_the_defaults_changed_comes_back_as_it_was(make_client, tmp_path):
    """Until 2026-11-26 a kvcache session made without `top_k` and `selection` selected by summaries
    with top_k 8, and its saved state held neither the options nor a text index: it comes back so."""
    settings = dict(data_dir=tmp_path / "sessions")
    client = make_client(**settings)
    session_id = new_session(client, memory="kvcache", options={**KVCACHE_SIZES, "top_k": 8, "selection": "summary"})
    client.post(f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT})
    before = client.post(f"/v1/sessions/{session_id}/ask", json=QUESTION).json()
    client.__exit__(None, None, None)
    store = SnapshotStore(tmp_path / "sessions")
    saved = store.read(session_id)
    assert saved.state.pop("options")["selection"] == "summary"  # as saved from now on
    old = Snapshot({**saved.session, "options": KVCACHE_SIZES}, saved.state)  # as saved before
    store.write(old, expected=saved.generation)

    restarted = make_client(**settings)
    after = restarted.post(f"/v1/sessions/{session_id}/ask", json=QUESTION).json()
    assert after["answer"] == before["answer"] and after["retrieval"]["items"] == before["retrieval"]["items"]
    options = session_of(restarted, session_id).memory.options
    assert (options.top_k, options.selection) == (8, "summary")


def test_a_kvcache_session_saved_before_reread_comes_back_answering_as_it_did(make_client, tiny_dir, tmp_path):
    """Until 2026-11-27 a kvcache session attended its picks' stored keys and values and its text
    index ranked with the `text` memory's built-in defaults; its saved state held neither the token
    ids `reread` needs, nor the option, nor the index's options. It comes back answering so, on a
    model whose manifest now sets other `text` defaults, which a new session ranks with."""
    measured = tmp_path / tiny_dir.name
    shutil.copytree(tiny_dir, measured)
    settings = dict(data_dir=tmp_path / "sessions", model=[str(measured)])
    client = make_client(**settings)
    session_id = new_session(client, memory="kvcache", options={**KVCACHE_TEXT, "reread": False})
    client.post(f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT})
    before = client.post(f"/v1/sessions/{session_id}/ask", json=QUESTION).json()
    client.__exit__(None, None, None)
    store = SnapshotStore(tmp_path / "sessions")
    saved = store.read(session_id)
    saved.state.pop("token_ids")
    saved.state.pop("text_options")
    assert saved.state["options"].pop("reread") is False
    store.write(Snapshot({**saved.session, "options": KVCACHE_TEXT}, saved.state), expected=saved.generation)
    (measured / "longdoc.json").write_text(
        json.dumps({"memory_options": {"text": {"margin": 0.001, "dense_weight": 0.9, "sentence_share": 0.5}}})
    )

    restarted = make_client(**settings)
    after = restarted.post(f"/v1/sessions/{session_id}/ask", json=QUESTION).json()
    assert after["answer"] == before["answer"] and after["retrieval"]["items"] == before["retrieval"]["items"]
    memory = session_of(restarted, session_id).memory
    assert memory.options.reread is False and memory.text_index.options == TextOptions()
    assert len(memory.text_index.store.sentences.vectors) == 0  # its own options decided what was loaded, not the manifest's
    fresh = new_session(restarted, memory="kvcache", options=KVCACHE_TEXT)
    assert session_of(restarted, fresh).memory.text_index.options.margin == 0.001


def test_a_cleared_cache_and_a_deleted_session_stay_so(make_client, tmp_path):
    client = make_client(data_dir=tmp_path / "sessions")
    kept, gone = new_session(client, memory="text"), new_session(client, memory="text")
    for session_id in (kept, gone):
        client.post(f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT})
    client.delete(f"/v1/sessions/{kept}/cache")
    client.delete(f"/v1/sessions/{gone}")
    assert not (tmp_path / "sessions" / gone).exists()
    client.__exit__(None, None, None)
    restarted = make_client(data_dir=tmp_path / "sessions")
    assert [s["id"] for s in restarted.get("/v1/sessions").json()["data"]] == [kept]
    assert restarted.get(f"/v1/sessions/{kept}").json()["documents"] == []


def test_an_unreadable_snapshot_is_skipped_and_kept(make_client, tmp_path):
    client = make_client(data_dir=tmp_path / "sessions")
    good, bad = new_session(client, memory="text"), new_session(client, memory="text")
    client.__exit__(None, None, None)
    manifest = tmp_path / "sessions" / bad / "session.json"
    manifest.write_text("{ not json")
    restarted = make_client(data_dir=tmp_path / "sessions")
    assert [s["id"] for s in restarted.get("/v1/sessions").json()["data"]] == [good]
    assert manifest.read_text() == "{ not json"  # left for an operator
    assert "longdoc_session_snapshot_failures 1.0" in restarted.get("/metrics").text


def test_idle_sessions_leave_ram_for_disk(make_client, tmp_path):
    client = make_client(data_dir=tmp_path / "sessions", session_ttl_seconds=0.2)
    session_id = new_session(client, memory="text")
    client.post(f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT})
    answer = client.post(f"/v1/sessions/{session_id}/ask", json=QUESTION).json()["answer"]
    engine = client.app.state.engine
    session = next(s for s in engine.sessions.list() if s.id == session_id)  # list() does not count as use
    deadline = time.monotonic() + 10
    while session.resident and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not session.resident and engine.sessions.used_bytes() == 0
    assert client.post(f"/v1/sessions/{session_id}/ask", json=QUESTION).json()["answer"] == answer


def test_a_session_in_use_is_never_evicted_for_its_own_answer(make_client, tmp_path):
    probe = make_client(data_dir=tmp_path / "probe")
    session_id = new_session(probe, memory="text")
    probe.post(f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT})
    prompt = probe.post(f"/v1/sessions/{session_id}/ask", json=QUESTION).json()["usage"]["prompt_tokens"]
    engine = probe.app.state.engine
    held = engine.sessions.peek(session_id).memory_bytes
    per_token, block = engine.models.runtimes()[0].loaded.kv_bytes_per_token, engine.config.generation.kv_block_tokens
    answer = (math.ceil((prompt + 1) / block) * block + prompt) * per_token  # its blocks and its prompt's cache, at most
    client = make_client(data_dir=tmp_path / "a", max_memory_bytes=held + answer + held // 2)  # one session and its answer
    a, b = new_session(client, memory="text"), new_session(client, memory="text")
    for session_id in (a, b):
        client.post(f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT})
    assert client.post(f"/v1/sessions/{a}/ask", json=QUESTION).status_code == 200  # b made room
    resident = {s["id"]: s["resident"] for s in client.get("/v1/sessions").json()["data"]}
    assert resident == {a: True, b: False}
    # its answer's blocks do not fit beside what others hold: it waits, then 429, never evicting itself
    tight = make_client(data_dir=tmp_path / "b", max_memory_bytes=held + answer + held // 2, kv_wait_seconds=0.5)
    session_id = new_session(tight, memory="text")
    tight.post(f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT})
    store = tight.app.state.engine.sessions
    blocker = store.reserve(None, held + answer // 2, transient=True)  # other work in flight
    response = tight.post(f"/v1/sessions/{session_id}/ask", json=QUESTION)
    assert response.status_code == 429 and response.json()["error"]["type"] == "memory_budget_exceeded"
    assert tight.get(f"/v1/sessions/{session_id}").json()["resident"] is True
    blocker.release()
    assert store.reserved_bytes == 0
    assert tight.post(f"/v1/sessions/{session_id}/ask", json=QUESTION).status_code == 200  # once it is given back


def test_a_session_deleted_while_it_is_saved_stays_deleted(make_client, tmp_path):
    client = make_client(data_dir=tmp_path / "sessions")
    session_id = new_session(client, memory="text")
    hold, thread, result = ingest_held(client, session_id)
    assert client.delete(f"/v1/sessions/{session_id}").status_code == 204
    hold.released.set()
    thread.join(60)
    assert result[0].status_code == 404
    assert not (tmp_path / "sessions" / session_id).exists()
    client.__exit__(None, None, None)
    assert make_client(data_dir=tmp_path / "sessions").get("/v1/sessions").json()["data"] == []


def test_a_full_disk_is_507_and_keeps_the_session_in_ram(make_client, tmp_path, monkeypatch):
    import errno

    client = make_client(data_dir=tmp_path / "sessions", session_ttl_seconds=0.2)
    session_id = new_session(client, memory="text")
    store = client.app.state.engine.session_service.snapshots

    def full(snapshot, expected=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "write", full)
    error = client.post("/v1/sessions", json={"memory": "text"})
    assert error.status_code == 507 and error.json()["error"]["type"] == "insufficient_storage"
    assert [s["id"] for s in client.get("/v1/sessions").json()["data"]] == [session_id]  # the failed one is gone
    assert client.post(f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT}).status_code == 507
    time.sleep(1.0)  # idle past its TTL: a session with unsaved changes stays in RAM
    session = next(s for s in client.app.state.engine.sessions.list() if s.id == session_id)
    assert session.resident and session.dirty
    monkeypatch.undo()
    assert client.post(f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT}).status_code == 201
    assert not session.dirty


def test_a_text_session_saved_by_another_embedder_is_embedded_again_once(make_client, tmp_path):
    """Vectors saved by plain MiniLM are made again by a server with the adapter when the session
    is first used, and saved, so the next load reads them as they are."""
    folder = tmp_path / "sessions"
    client = make_client(data_dir=folder, embedder_adapter="none")
    session_id = new_session(client, memory="text")
    client.post(f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT})
    saved = SnapshotStore(folder).read(session_id)
    assert saved.state["embedder"] == "all-MiniLM-L6-v2"
    client.__exit__(None, None, None)
    restarted = make_client(data_dir=folder)
    answer = restarted.post(f"/v1/sessions/{session_id}/ask", json={"question": "Which colour?", "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    again = SnapshotStore(folder).read(session_id)
    assert again.state["embedder"].startswith("all-MiniLM-L6-v2+adapter@")
    assert again.generation > saved.generation
    assert not np.allclose(again.state["vectors"], saved.state["vectors"], atol=1e-3)
