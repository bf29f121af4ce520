"""A freshly started server's first greedy answer against the same request's later answers: the
server is started `starts` times, and each time a default session takes Paradise Lost (132K tokens)
and is asked one question twice. Passes when every start answered the same, first and second."""

from __future__ import annotations

import collections
from typing import Any

import httpx

from scripts.drills.server import Server

QUESTION = {"question": "Which angel did Heaven's King send to converse with Adam and warn him?", "max_tokens": 32}


def run_first(server_args: list[str], book: str, starts: int) -> dict[str, Any]:
    """Per start: the first answer, and whether the second differed from it."""
    firsts: collections.Counter[str] = collections.Counter()
    differs = 0
    for _ in range(starts):
        server = Server(server_args).start()
        try:
            with httpx.Client(base_url=server.url, timeout=600) as client:
                session = client.post("/v1/sessions", json={})
                session.raise_for_status()
                session_id = session.json()["id"]
                client.post(f"/v1/sessions/{session_id}/documents", json={"text": book}).raise_for_status()
                first, second = (_ask(client, session_id), _ask(client, session_id))
        finally:
            server.stop()
        firsts[first] += 1
        differs += first != second
    return {"starts": starts, "first_answers": dict(firsts), "first_differs_from_second": differs}


def _ask(client: httpx.Client, session_id: str) -> str:
    response = client.post(f"/v1/sessions/{session_id}/ask", json=QUESTION)
    response.raise_for_status()
    return str(response.json()["answer"])


def first_passed(result: dict[str, Any]) -> bool:
    return len(result["first_answers"]) == 1 and result["first_differs_from_second"] == 0
