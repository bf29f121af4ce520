"""`kill -9` in the middle of an ingestion, then a restart on the same data folder: every document
committed before comes back, and answers as before; the one being ingested is gone."""

from __future__ import annotations

import json
import time

import httpx

from scripts.drills.server import Server

QUESTION = {"question": "Who did Alice follow down the rabbit-hole?", "max_tokens": 16}


def run_crash(server_args: list[str], book: str, *, memory: str | None, kept_documents: int = 2) -> dict:
    server = Server(server_args).start()
    try:
        client = httpx.Client(base_url=server.url, timeout=600)
        session_id = client.post("/v1/sessions", json={"memory": memory} if memory else {}).json()["id"]
        step = len(book) // (kept_documents + 2)
        kept = [
            client.post(f"/v1/sessions/{session_id}/documents", json={"text": book[i * step : (i + 1) * step]}).json()
            for i in range(kept_documents)
        ]
        before = client.post(f"/v1/sessions/{session_id}/ask", json=QUESTION).json()
        cache_before = client.get(f"/v1/sessions/{session_id}/cache").json()
        progress = 0
        with client.stream(
            "POST", f"{server.url}/v1/sessions/{session_id}/documents?stream=true", json={"text": book}
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data:") and "segments_done" in line:
                    progress = json.loads(line[5:])["segments_done"]
                    if progress >= 2:
                        server.kill()  # mid-ingestion, no warning
                        break
    finally:
        if server.alive():
            server.kill()
    restarted = Server(server_args, data_dir=server.data_dir)
    started = time.perf_counter()
    restarted.start()
    try:
        restart_seconds = time.perf_counter() - started
        client = httpx.Client(base_url=restarted.url, timeout=600)
        info = client.get(f"/v1/sessions/{session_id}").json()
        after = client.post(f"/v1/sessions/{session_id}/ask", json=QUESTION).json()
        return {
            "memory": info.get("memory"),
            "documents_before": [d["id"] for d in kept],
            "documents_after": [d["id"] for d in info.get("documents", [])],
            "killed_at_segment": progress,
            "cache_same": client.get(f"/v1/sessions/{session_id}/cache").json() == cache_before,
            "answer_before": before["answer"],
            "answer_after": after.get("answer"),
            "restart_to_ready_seconds": round(restart_seconds, 1),
        }
    finally:
        restarted.stop()


def crash_passed(result: dict) -> bool:
    return (
        result["documents_after"] == result["documents_before"]
        and result["cache_same"]
        and result["answer_after"] == result["answer_before"]
        and result["killed_at_segment"] >= 2
    )
