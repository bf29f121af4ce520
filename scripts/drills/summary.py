"""Background summaries (issue 61): how long the default model takes to write a book's summary
tree, and how quickly questions are answered while it does.

One `text` session holds the book as it is; its questions, asked on the idle server, give the
baseline first-token times. Then a second session is given the same book with `summarize`, and
the same questions are asked on the first session again while the second one's summaries are
written. Reports both sets of first-token times, the build's time (from the end of the ingestion
to the cache info's "ready") and its summaries; passes when every question is answered and the
build ends ready.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx

from scripts.drills.server import Server

QUESTIONS = (
    "What are the names of the three little sisters in the Dormouse's story?",
    "Who is the Mock Turtle's teacher, and what did he teach?",
    "What does the Caterpillar smoke, and where does it sit?",
)
ANSWER_TOKENS = 32
POLL_SECONDS = 2.0


async def _ttft(client: httpx.AsyncClient, session: str, question: str) -> float | None:
    """Seconds to the first streamed token, the answer read to its end; None when none came."""
    started = time.perf_counter()
    body = {"question": question, "stream": True, "max_tokens": ANSWER_TOKENS, "temperature": 0}
    async with client.stream("POST", f"/v1/sessions/{session}/ask", json=body) as response:
        if response.status_code != 200:
            return None
        first = None
        async for line in response.aiter_lines():  # the whole answer is read
            if line == "event: delta" and first is None:
                first = time.perf_counter() - started
    return first


async def _session(client: httpx.AsyncClient, book: str, options: dict) -> str:
    session = (await client.post("/v1/sessions", json={"memory": "text", "options": options})).json()["id"]
    response = await client.post(f"/v1/sessions/{session}/documents", json={"text": book, "name": "book.txt"})
    response.raise_for_status()
    return session


async def _cache(client: httpx.AsyncClient, session: str) -> dict:
    return (await client.get(f"/v1/sessions/{session}/cache")).json()


async def run_summary(server: Server, book: str) -> dict:
    async with httpx.AsyncClient(base_url=server.url, timeout=3600) as client:
        plain = await _session(client, book, {})
        await _ttft(client, plain, QUESTIONS[0])  # warm
        idle = [await _ttft(client, plain, question) for question in QUESTIONS]
        summarizing = await _session(client, book, {"summarize": True})
        started = time.perf_counter()
        meanwhile: list[float | None] = []
        cache = await _cache(client, summarizing)
        while cache["summary_state"] == "building":
            if len(meanwhile) < 3 * len(QUESTIONS):
                meanwhile.append(await _ttft(client, plain, QUESTIONS[len(meanwhile) % len(QUESTIONS)]))
            else:
                await asyncio.sleep(POLL_SECONDS)
            cache = await _cache(client, summarizing)
        seconds = time.perf_counter() - started
        for session in (plain, summarizing):
            await client.delete(f"/v1/sessions/{session}")
    answered = [t for t in meanwhile if t is not None]
    return {
        "book_chars": len(book),
        "build_seconds": round(seconds, 1),
        "summaries": cache["summaries"],
        "summaries_planned": cache["summaries_planned"],
        "summary_state": cache["summary_state"],
        "ttft_idle_s": [None if t is None else round(t, 2) for t in idle],
        "ttft_meanwhile_s": [None if t is None else round(t, 2) for t in meanwhile],
        "ttft_idle_median_s": round(statistics.median(t for t in idle if t is not None), 2) if any(idle) else None,
        "ttft_meanwhile_median_s": round(statistics.median(answered), 2) if answered else None,
        "ttft_meanwhile_max_s": round(max(answered), 2) if answered else None,
        "alive": server.alive(),
    }


def summary_passed(result: dict) -> bool:
    return (
        result["summary_state"] == "ready"
        and None not in result["ttft_idle_s"]
        and None not in result["ttft_meanwhile_s"]
        and bool(result["ttft_meanwhile_s"])
        and result["alive"]
    )
