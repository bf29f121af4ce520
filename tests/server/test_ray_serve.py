"""Scale-out on a real local Ray cluster (loopback): `longdoc serve-ray` with 2 replicas on the
tiny model. 8 sessions are made, fed and asked in parallel; every request for a session lands on
the replica that owns it (the x-longdoc-replica header); one replica's process is killed, and its
sessions answer from the survivors as they did before, their documents intact."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from scripts.drills.server import Server
from server.ray_serve.routing import named_replica
from tests.helpers import CACHE_DIR

pytestmark = pytest.mark.ray

LOG = Path("test-artifacts/ray-serve.log")
SESSIONS = 8
REPLICA = "x-longdoc-replica"


def document(i: int) -> str:
    return f"Harbour {i} keeps the lamp number {1000 + i} and a boat called Wren-{i}. " * 30


def ask(url: str, session_id: str) -> httpx.Response:
    body = {"question": "Which lamp does the harbour keep?", "max_tokens": 8}
    return httpx.post(f"{url}/v1/sessions/{session_id}/ask", json=body, timeout=120)


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-serve")
    args = [
        *("--replicas", "2", "--metrics-targets-dir", str(root / "targets"), "--model", str(tiny_dir)),
        *("--dtype", "float32", "--cache-dir", str(CACHE_DIR), "--segment-len", "64"),
    ]
    LOG.parent.mkdir(exist_ok=True)  # the log is kept after the run
    server = Server(args, command="serve-ray", env={"RAY_USAGE_STATS_ENABLED": "0"}, log=LOG, data_dir=root / "sessions")
    server.start(timeout=240)
    assert server.process is not None
    deadline = time.monotonic() + 60  # both replicas are up once each has written its metrics target
    while len(list((root / "targets").glob("*.json"))) < 2:
        assert time.monotonic() < deadline, "the replicas did not write their metrics targets"
        time.sleep(1)
    # the ingress's router learns of running replicas from Serve's controller a moment later, and a
    # new session's turn goes over the replicas it knows: wait until requests reach both
    seen: set[str] = set()
    while len(seen) < 2:
        assert time.monotonic() < deadline, f"the ingress reached only {seen}"
        seen.add(httpx.get(f"{server.url}/v1/models", timeout=10).headers[REPLICA])
    yield server.url, root / "targets"
    server.stop()  # a graceful stop: Serve, then Ray, shut down
    with pytest.raises(ProcessLookupError):  # nothing started in its process group outlives it
        os.killpg(server.process.pid, signal.SIGKILL)


def pid_of(targets: Path, replica: str) -> int:
    return int(json.loads((targets / f"{replica}.json").read_text())[0]["labels"]["pid"])


def test_sessions_stay_on_their_replica_and_survive_its_death(cluster):
    url, targets = cluster
    with ThreadPoolExecutor(SESSIONS) as pool:
        made = list(pool.map(lambda _: httpx.post(f"{url}/v1/sessions", json={"memory": "text"}, timeout=60), range(SESSIONS)))
        owners = {r.json()["id"]: r.headers[REPLICA] for r in made}
        assert all(named_replica(s) == owner for s, owner in owners.items())  # a replica names its sessions
        assert sorted(Counter(owners.values()).values()) == [4, 4], owners  # new sessions go to each replica in turn

        ids = sorted(owners)
        fed = list(
            pool.map(
                lambda i: httpx.post(f"{url}/v1/sessions/{ids[i]}/documents", json={"text": document(i)}, timeout=120),
                range(SESSIONS),
            )
        )
        answers = list(pool.map(lambda s: ask(url, s), ids))
    for session_id, response in zip(ids, fed, strict=True):
        assert response.status_code == 201 and response.headers[REPLICA] == owners[session_id]
    for session_id, response in zip(ids, answers, strict=True):
        assert response.status_code == 200 and response.headers[REPLICA] == owners[session_id]
    before = {s: r.json() for s, r in zip(ids, answers, strict=True)}

    victim = owners[ids[0]]
    os.kill(pid_of(targets, victim), signal.SIGKILL)
    orphans = [s for s in ids if owners[s] == victim]
    for session_id in ids:
        response = httpx.get(f"{url}/v1/sessions/{session_id}", timeout=60)  # GETs are retried on a new owner
        assert response.status_code == 200, response.text
        assert response.headers[REPLICA] != victim
        if session_id not in orphans:
            assert response.headers[REPLICA] == owners[session_id]  # the others did not move
        assert [d["id"] for d in response.json()["documents"]] == [fed[ids.index(session_id)].json()["id"]]
    for session_id in orphans:
        response = ask(url, session_id)
        assert response.status_code == 200 and response.headers[REPLICA] != victim
        after = response.json()
        assert after["answer"] == before[session_id]["answer"]
        assert after["retrieval"]["items"] == before[session_id]["retrieval"]["items"]
    print(f"killed replica {victim}: {len(orphans)} of {SESSIONS} sessions answered from the others as before")


def test_the_ingress_refuses_a_body_over_the_limit_as_the_api_does(cluster):
    url, _ = cluster
    too_big = b"x" * (32 * 1024**2 + 128 * 1024)  # over max_document_bytes and the multipart slack
    response = httpx.post(f"{url}/v1/sessions/s-any/documents", content=too_big, timeout=60)
    assert response.status_code == 413 and response.json()["error"]["type"] == "too_large"
