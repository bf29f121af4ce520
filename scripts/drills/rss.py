"""Do the books match the machine? Session memory as /metrics counts it, against the server's
measured RSS growth, for memory allocated up front (neurocache caches) and memory that grows with
documents (text chunks and vectors)."""

from __future__ import annotations

import time

import httpx

from scripts.drills.server import Server

TOLERANCE = 0.20


def _settle(server: Server) -> int:
    time.sleep(1.0)
    return server.rss_bytes()


def _measure(server: Server, client: httpx.Client, make) -> dict:
    counted_before, rss_before = server.metric("longdoc_session_memory_bytes"), _settle(server)
    made = make()
    counted_after, rss_after = server.metric("longdoc_session_memory_bytes"), _settle(server)
    for session_id in made:
        client.delete(f"/v1/sessions/{session_id}")
    counted, grown = counted_after - counted_before, rss_after - rss_before
    return {
        "sessions": len(made),
        "counted_mib": round(counted / 2**20, 1),
        "rss_growth_mib": round(grown / 2**20, 1),
        "ratio": round(grown / counted, 3) if counted else None,
        "rss_after_delete_mib": round(_settle(server) / 2**20, 1),
    }


TEXT_OPTIONS = {"chunk_tokens": 16}  # ~8x the default's chunks: a book's memory (~3.8 MiB) stands
# well above the few MiB that RSS moves by on its own


def run_rss(server: Server, book: str, *, caches: int, capacity: int, documents: int) -> dict:
    client = httpx.Client(base_url=server.url, timeout=600)

    def neurocache_sessions(n: int) -> list[str]:
        body = {"memory": "neurocache", "options": {"capacity": capacity}}
        return [client.post("/v1/sessions", json=body).json()["id"] for _ in range(n)]

    def text_sessions(n: int) -> list[str]:
        made = []
        for _ in range(n):
            session_id = client.post("/v1/sessions", json={"memory": "text", "options": TEXT_OPTIONS}).json()["id"]
            client.post(f"/v1/sessions/{session_id}/documents", json={"text": book})
            made.append(session_id)
        return made

    # warm up with the same work: its first run allocates buffers (embedding batches of these
    # shapes, tokenizer caches) that stay, and are not session memory
    for session_id in text_sessions(2) + neurocache_sessions(1):
        client.delete(f"/v1/sessions/{session_id}")
    return {
        "neurocache": _measure(server, client, lambda: neurocache_sessions(caches)),
        "text": _measure(server, client, lambda: text_sessions(documents)),
    }


def rss_passed(result: dict) -> bool:
    return all(row["ratio"] is not None and abs(row["ratio"] - 1) <= TOLERANCE for row in result.values())
