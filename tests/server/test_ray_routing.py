"""The pieces of the Ray Serve application that need no cluster: who owns a session, which session
a request names, the in-process ASGI relay, replica options, and the Prometheus file_sd entries."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import string
import time
from pathlib import Path

import pytest

from server.ray_serve.asgi import ForwardedRequest, ResponseStart, run_asgi
from server.ray_serve.deployments import ScaleOut, metrics_target
from server.ray_serve.routing import in_turn, makes_session, named_replica, owner_of, session_in, session_prefix
from tests.helpers import new_session


def random_ids(n: int) -> list[str]:
    rng = random.Random(0)
    return ["s-" + "".join(rng.choices(string.hexdigits.lower(), k=16)) for _ in range(n)]


def test_a_session_belongs_to_the_replica_its_id_names_while_that_replica_lives():
    session_id = session_prefix("abc12345") + "0011223344556677"
    assert named_replica(session_id) == "abc12345"
    assert owner_of(session_id, ["zz", "abc12345", "yy"]) == "abc12345"
    assert owner_of(session_id, ["zz", "yy"]) in {"zz", "yy"}  # its replica is gone: another owns it
    assert named_replica("s-0011223344556677") is None


def test_rendezvous_owners_agree_and_move_only_the_lost_replicas_sessions():
    ids, replicas = random_ids(400), ["r1", "r2", "r3", "r4"]
    before = {s: owner_of(s, replicas) for s in ids}
    assert before == {s: owner_of(s, list(reversed(replicas))) for s in ids}  # order does not matter
    assert all(sum(o == r for o in before.values()) > 60 for r in replicas)  # spread over all four
    after = {s: owner_of(s, ["r1", "r2", "r4"]) for s in ids}
    moved = {s for s in ids if after[s] != before[s]}
    assert moved == {s for s in ids if before[s] == "r3"}


def test_new_sessions_go_to_the_replicas_in_turn():
    replicas = ["r2", "r0", "r1"]
    assert [in_turn(turn, replicas) for turn in range(7)] == ["r0", "r1", "r2", "r0", "r1", "r2", "r0"]
    assert in_turn(5, ["only"]) == "only"
    assert makes_session("POST", "/v1/sessions") and makes_session("POST", "/v1/sessions/")
    assert not makes_session("GET", "/v1/sessions") and not makes_session("POST", "/v1/sessions/s-1/ask")


def test_the_session_a_request_names():
    assert session_in("GET", "/v1/sessions/s-1", b"") == "s-1"
    assert session_in("POST", "/v1/sessions/s-1/ask", b"{}") == "s-1"
    assert session_in("DELETE", "/v1/sessions/s-1/cache", b"") == "s-1"
    assert session_in("GET", "/v1/sessions", b"") is None
    assert session_in("POST", "/v1/sessions", b'{"memory": "text"}') is None
    assert session_in("POST", "/v1/chat/completions", b'{"session_id": "s-2", "messages": []}') == "s-2"
    assert session_in("POST", "/v1/chat/completions", b'{"messages": []}') is None
    assert session_in("POST", "/v1/chat/completions", b"not json") is None
    assert session_in("POST", "/v1/chat/completions", b'["a list"]') is None
    assert session_in("POST", "/v1/chat/completions", b'{"session_id": 7}') is None


def relayed(client, method: str, path: str, body: bytes = b"", stop_after: int | None = None) -> list:
    """What `run_asgi` yields for a request to the client's app, run on the app's own loop."""

    async def collect() -> list:
        request = ForwardedRequest(method, path, b"", [(b"content-type", b"application/json")], body)
        items: list = []
        stream = run_asgi(client.app, request, [(b"x-longdoc-replica", b"r0")])
        async for item in stream:
            items.append(item)
            if stop_after is not None and len(items) >= stop_after:
                break
        await stream.aclose()
        return items

    return client.portal.call(collect)


def test_the_relay_streams_the_apps_response_with_the_replica_header(client):
    items = relayed(client, "GET", "/v1/models")
    start, body = items[0], b"".join(items[1:])
    assert isinstance(start, ResponseStart) and start.status == 200
    assert (b"x-longdoc-replica", b"r0") in start.headers
    assert json.loads(body)["data"][0]["object"] == "model"

    session_id = new_session(client, memory="text")
    client.post(f"/v1/sessions/{session_id}/documents", json={"text": "The lighthouse is violet. " * 40})
    ask = json.dumps({"question": "What colour?", "max_tokens": 6, "stream": True}).encode()
    items = relayed(client, "POST", f"/v1/sessions/{session_id}/ask", ask)
    assert items[0].status == 200 and len(items) > 3  # event by event, not one buffered body
    events = b"".join(items[1:]).decode()
    assert events.startswith("event: retrieval") and "event: done" in events

    # a consumer that goes away mid-stream: the app is told, and the session serves the next request
    items = relayed(client, "POST", f"/v1/sessions/{session_id}/ask", ask, stop_after=2)
    assert len(items) == 2
    assert client.post(f"/v1/sessions/{session_id}/ask", json={"question": "What colour?", "max_tokens": 4}).status_code == 200


def test_a_slow_consumer_holds_the_app_back_and_one_that_leaves_stops_it():
    """The app (one that watches for the disconnect, as Starlette's streams do) gets at most the
    relay's queue ahead of the consumer; told the consumer left, it ends, and closing waits for that."""
    from server.ray_serve.asgi import QUEUED_MESSAGES

    sent: list[int] = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        left = asyncio.ensure_future(receive())  # the request body
        await left
        left = asyncio.ensure_future(receive())  # then: the disconnect
        for i in range(100_000):
            if left.done():
                sent.append(-1)
                return
            await send({"type": "http.response.body", "body": b"%d," % i, "more_body": True})
            sent.append(i)

    async def consume() -> tuple[list, int, float]:
        stream = run_asgi(app, ForwardedRequest("GET", "/", b"", [], b""), [])
        items = [await stream.__anext__(), await stream.__anext__()]
        await asyncio.sleep(0.2)  # the app runs ahead as far as it may
        ahead = len(sent)
        began = time.monotonic()
        await stream.aclose()
        return items, ahead, time.monotonic() - began

    items, ahead, closing = asyncio.run(consume())
    assert isinstance(items[0], ResponseStart) and items[1] == b"0,"
    assert ahead <= QUEUED_MESSAGES + 2
    assert sent[-1] == -1 and closing < 1.0  # it saw the disconnect and ended


def test_an_app_that_ignores_the_disconnect_is_cancelled_even_when_the_closer_is():
    ended: list[str] = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            while True:  # never looks at receive()
                await send({"type": "http.response.body", "body": b"x", "more_body": True})
                await asyncio.sleep(0.01)
        finally:
            ended.append("ended")

    async def consume() -> float:
        stream = run_asgi(app, ForwardedRequest("GET", "/", b"", [], b""), [])
        await stream.__anext__()
        closing = asyncio.ensure_future(stream.aclose())
        await asyncio.sleep(0.1)  # the relay is draining, waiting for the app's end
        began = time.monotonic()
        closing.cancel()  # the request's own task is cancelled mid-drain
        with contextlib.suppress(asyncio.CancelledError):
            await closing
        await asyncio.sleep(0.2)
        assert ended == ["ended"]  # before the loop ends (which would cancel it anyway)
        return time.monotonic() - began

    assert asyncio.run(consume()) < 1.0


def test_the_relay_answers_errors_as_the_app_does(client):
    items = relayed(client, "GET", "/v1/sessions/s-nope")
    assert items[0].status == 404 and json.loads(b"".join(items[1:]))["error"]["type"] == "not_found"


def test_replica_options():
    assert ScaleOut(replicas=3).deployment_options()["num_replicas"] == 3
    auto = ScaleOut(min_replicas=1, max_replicas=4).deployment_options()
    assert "num_replicas" not in auto and auto["autoscaling_config"]["max_replicas"] == 4
    for bad in (ScaleOut(replicas=0), ScaleOut(min_replicas=3, max_replicas=2)):
        with pytest.raises(ValueError):
            bad.deployment_options()


def test_replicas_need_their_sessions_on_disk():
    from server.ray_serve.deployments import build
    from server.settings import Settings

    with pytest.raises(ValueError, match="persist_sessions"):
        build(Settings(persist_sessions=False), ScaleOut())


def test_metrics_targets_are_written_and_dead_replicas_entries_removed(tmp_path):
    dead = tmp_path / "gone.json"
    dead.write_text(json.dumps([{"targets": ["127.0.0.1:1"], "labels": {"replica": "gone", "pid": "999999999"}}]))
    elsewhere = tmp_path / "far.json"  # another host: its process cannot be checked from here
    elsewhere.write_text(json.dumps([{"targets": ["10.0.0.9:1"], "labels": {"replica": "far", "pid": "999999999"}}]))
    path = metrics_target(tmp_path, "r1", "127.0.0.1", 9100)
    assert json.loads(path.read_text()) == [{"targets": ["127.0.0.1:9100"], "labels": {"replica": "r1", "pid": str(os.getpid())}}]
    assert not dead.exists() and elsewhere.exists()


@pytest.mark.parametrize("path", ["deploy/ray/serve.yaml", "deploy/k8s/rayservice.yaml"])
def test_the_shipped_serve_configs_build_the_application(path, monkeypatch, tmp_path):
    import yaml  # type: ignore[import-untyped]  # PyYAML, installed with Ray, ships no stubs
    from ray.serve.deployment import Application

    from server.ray_serve import deployments

    documents = list(yaml.safe_load_all(Path(path).read_text()))
    config = documents[0]
    if config.get("kind") == "RayService":
        config = yaml.safe_load(config["spec"]["serveConfigV2"])
    (app,) = config["applications"]
    assert app["import_path"] == "server.ray_serve.deployments:app_builder"
    monkeypatch.setenv("LONGDOC_DATA_DIR", str(tmp_path))
    assert set(app["args"]) <= set(deployments.ScaleOut.__dataclass_fields__)
    assert isinstance(deployments.app_builder(app["args"]), Application)
