"""Background summary trees (engine/memories/text/summary.py, engine/summarize.py): planned from
the chunks, written by the served model behind the answers, kept through a restart, stopped by a
delete, counted against the session's budget, and handed to whole-document questions."""

from __future__ import annotations

import time

import numpy as np
import pytest

from engine.memories.base import SummaryTask
from engine.memories.text.summary import SummaryTree, framed, level_sizes, part_spans
from tests.helpers import new_session, session_of

SUMMARIZE = {"summarize": True, "summary_part_tokens": 128, "summary_fanout": 2}
# 918 tokens of the tiny model: 8 parts, 15 summaries in all
STORY = " ".join(f"On day {n} the keeper of Velmora lit lamp number {n} and wrote it in the log." for n in range(1, 40))


def test_parts_cover_every_chunk_in_order_within_the_budget():
    tokens = np.array([100, 100, 30, 200, 50, 50, 50], np.int32)
    starts = np.cumsum([0, *tokens[:-1].tolist()]) * 4
    spans = np.stack([starts, starts + tokens * 4], axis=1)
    parts = part_spans(spans, tokens, 160)
    # [100] [100 30] [200] alone, over the budget; [50 50 50]
    assert parts == [(0, 400), (400, 920), (920, 1720), (1720, 2320)]
    assert (
        level_sizes(4, 2) == [4, 2, 1] and level_sizes(1, 8) == [1] and level_sizes(0, 8) == [] and level_sizes(9, 8) == [9, 2, 1]
    )


def _written(tree: SummaryTree, task: SummaryTask, dim: int, seed: int) -> None:
    tree.add(task, f"summary of {task.key}", np.random.default_rng(seed).standard_normal(dim).astype(np.float32))


def test_a_tree_is_written_bottom_up_and_round_trips():
    dim, parts = 8, {"d-1": [(0, 10), (10, 20), (20, 30)]}
    text = {"d-1": "x" * 30}
    tree = SummaryTree(dim, 128, 2)
    assert tree.planned(parts) == 3 + 2 + 1
    first = tree.tasks(parts, text, 10, frozenset())
    assert [task.key for task in first] == [("d-1", 1, 0), ("d-1", 1, 1), ("d-1", 1, 2)]  # nothing above is ready
    assert [task.key for task in tree.tasks(parts, text, 10, frozenset({("d-1", 1, 0)}))][0] == ("d-1", 1, 1)
    for seed, task in enumerate(first[:2]):
        _written(tree, task, dim, seed)
    ready = tree.tasks(parts, text, 10, frozenset())
    assert [task.key for task in ready] == [("d-1", 1, 2), ("d-1", 2, 0)]
    assert ready[1].start == 0 and ready[1].end == 20 and "summary of ('d-1', 1, 1)" in ready[1].messages[0]["content"]
    for seed, task in enumerate(ready, start=5):
        _written(tree, task, dim, seed)
    second = tree.tasks(parts, text, 10, frozenset())
    assert [task.key for task in second] == [("d-1", 2, 1)]  # the odd part out gets a parent of its own
    _written(tree, second[0], dim, 9)
    _written(tree, tree.tasks(parts, text, 10, frozenset())[0], dim, 10)
    assert len(tree) == 6 and tree.tasks(parts, text, 10, frozenset()) == []
    back = SummaryTree(dim, 128, 2)
    back.load_state_dict(tree.state_dict())
    assert back.nodes == tree.nodes and np.array_equal(back.vectors, tree.vectors) and back.nbytes == tree.nbytes


def test_a_question_gets_the_summaries_of_its_place_or_the_top_and_the_nearest_parts():
    dim = 4
    tree = SummaryTree(dim, 128, 4)
    for index, vector in enumerate(np.eye(4, dtype=np.float32)):
        tree.add(SummaryTask(("d-1", 1, index), [], 8, 10 * index, 10 * index + 10), f"part {index}", vector)
    tree.add(SummaryTask(("d-1", 2, 0), [], 8, 0, 40), "whole", np.ones(4, np.float32) / 2)
    top, words = frozenset({("d-1", 2, 0)}), lambda text: len(text.split())
    located = tree.pieces(np.zeros(4, np.float32), frozenset({"d-1"}), [("d-1", 12, 25)], 100, words, top)
    assert [node.key for node, _ in located] == [("d-1", 1, 1), ("d-1", 1, 2)]
    query = np.array([0.0, 0.1, 0.0, 0.9], np.float32)
    chosen = tree.pieces(query, frozenset({"d-1"}), [], 100, words, top)
    assert [node.key for node, _ in chosen][0] == ("d-1", 2, 0)  # the whole document's first
    assert [node.index for node, _ in chosen[1:]] == [0, 1, 2, 3]  # then parts, in document order
    tight = tree.pieces(
        query, frozenset({"d-1"}), [], words(framed(tree.nodes[4], True)) + 2 * words(framed(tree.nodes[1], False)), words, top
    )
    assert [node.key for node, _ in tight] == [("d-1", 2, 0), ("d-1", 1, 1), ("d-1", 1, 3)]  # the two nearest
    assert tree.pieces(query, frozenset(), [], 100, words, top) == []  # another document's only


def _cache(client, session_id: str) -> dict:
    return client.get(f"/v1/sessions/{session_id}/cache").json()


def _wait(client, session_id: str, done, timeout: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout
    while not done(cache := _cache(client, session_id)):
        assert time.monotonic() < deadline, cache
        time.sleep(0.05)
    return cache


def test_a_session_writes_its_summaries_in_the_background_and_answers_with_them(client):
    session_id = new_session(client, memory="text", options=SUMMARIZE)
    assert _cache(client, session_id)["summary_state"] == "ready"  # nothing to write yet
    assert client.post(f"/v1/sessions/{session_id}/documents", json={"text": STORY}).status_code == 201
    answered = client.post(f"/v1/sessions/{session_id}/ask", json={"question": "Where is the log?", "max_tokens": 4})
    assert answered.status_code == 200  # questions are answered while the summaries are written
    cache = _wait(client, session_id, lambda c: c["summary_state"] != "building")
    assert cache["summary_state"] == "ready" and cache["summaries"] == cache["summaries_planned"] > 3
    nodes = session_of(client, session_id).memory.summaries.nodes
    top = max(nodes, key=lambda node: node.level)
    assert nodes[-1] == top and (top.start, top.index) == (0, 0) and top.end >= len(STORY) - 1  # the whole story's, last
    whole = client.post(f"/v1/sessions/{session_id}/ask", json={"question": "Summarize the story.", "max_tokens": 4}).json()
    items = whole["retrieval"]["items"]
    assert items[0]["gathered"] == "summary"  # the summaries come before the excerpts
    written = {node.text for node in nodes}
    assert all(item["text"] in written for item in items if item["gathered"] == "summary")  # their words, for the page
    assert all(item["text"] is None for item in items if item["gathered"] != "summary")
    local = client.post(f"/v1/sessions/{session_id}/ask", json={"question": "Which lamp is lit on day 7?", "max_tokens": 4})
    assert "summary" not in [item["gathered"] for item in local.json()["retrieval"]["items"]]
    plain = new_session(client, memory="text")
    assert _cache(client, plain)["summary_state"] is None and _cache(client, plain)["summaries"] == 0


def test_summaries_survive_a_restart_and_the_build_goes_on_where_it_stopped(make_client, tmp_path):
    settings = dict(data_dir=tmp_path / "sessions")
    client = make_client(**settings)
    session_id = new_session(client, memory="text", options=SUMMARIZE)
    client.post(f"/v1/sessions/{session_id}/documents", json={"text": STORY})
    stopped = _wait(client, session_id, lambda c: c["summaries"] >= 2)
    client.__exit__(None, None, None)  # the server stops part way

    restarted = make_client(**settings)
    saved = restarted.get(f"/v1/sessions/{session_id}").json()
    assert saved["resident"] is False and saved["cache"]["summary_state"] == "building"
    assert stopped["summaries"] <= saved["cache"]["summaries"] < saved["cache"]["summaries_planned"]
    kept = restarted.app.state.engine.session_service.snapshots.read(session_id).state["summary_texts"]
    restarted.post(f"/v1/sessions/{session_id}/ask", json={"question": "Where is the log?", "max_tokens": 2})  # loads it
    done = _wait(restarted, session_id, lambda c: c["summary_state"] != "building")
    assert done["summary_state"] == "ready" and done["summaries"] == done["summaries_planned"]
    texts = [node.text for node in session_of(restarted, session_id).memory.summaries.nodes]
    assert texts[: len(kept)] == kept  # the saved ones were kept, not written again


def test_deleting_a_session_stops_its_build(client):
    session_id = new_session(client, memory="text", options=SUMMARIZE)
    client.post(f"/v1/sessions/{session_id}/documents", json={"text": STORY * 3})
    _wait(client, session_id, lambda c: c["summaries"] >= 1)
    engine = client.app.state.engine
    build = engine.summarizer._builds[session_id]
    assert client.delete(f"/v1/sessions/{session_id}").status_code == 204
    deadline = time.monotonic() + 30
    while not build.done():
        assert time.monotonic() < deadline, "the build went on"
        time.sleep(0.05)
    batcher = engine.models.runtime(None).batcher
    deadline = time.monotonic() + 30
    while batcher.rows or batcher.waiting:  # its rows leave the batch
        assert time.monotonic() < deadline, (batcher.rows, batcher.waiting)
        time.sleep(0.05)
    assert engine.sessions.reserved_bytes == 0


def test_a_summary_the_budget_cannot_hold_stops_the_build_and_keeps_nothing(client, monkeypatch):
    session_id = new_session(client, memory="text", options=SUMMARIZE)
    memory = session_of(client, session_id).memory
    limit = client.app.state.engine.config.sessions.memory_budget_bytes
    monkeypatch.setattr(memory, "summary_bytes", lambda task: limit + 1)
    client.post(f"/v1/sessions/{session_id}/documents", json={"text": STORY})
    cache = _wait(client, session_id, lambda c: c["summary_state"] != "building")
    assert cache["summary_state"].startswith("stopped: ") and "session memory" in cache["summary_state"]
    assert cache["summaries"] == 0 and len(memory.summaries) == 0


@pytest.mark.parametrize("options", [{"summarize": 1}, {"summarize": True, "summary_part_tokens": 64}, {"summary_fanout": 1}])
def test_bad_summary_options_are_refused(shared_client, options):
    response = shared_client.post("/v1/sessions", json={"memory": "text", "options": options})
    assert response.status_code == 400, response.text
