"""Load: N concurrent sessions, each its own API key's, ingesting its own passage with a secret in
it and asking about it (plain, streamed, and a chat stream hung up after its first delta).

Passes when no response is a 5xx, no answer or retrieval ever holds another session's document,
each key lists only its own sessions, the queues drain to 0 and the session memory drains to 0.
A 429 is retried after its Retry-After, as a client should, and counted.
"""

from __future__ import annotations

import asyncio
import json
import random
import string
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from scripts.drills.server import Server

BOOK = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "alice29.txt"
CODENAMES = [
    "amber",
    "birch",
    "cobalt",
    "dune",
    "ember",
    "fjord",
    "garnet",
    "harbor",
    "indigo",
    "juniper",
    "kestrel",
    "lichen",
    "marble",
    "nectar",
    "onyx",
    "pewter",
    "quartz",
    "russet",
    "saffron",
    "tundra",
    "umber",
    "velvet",
    "willow",
    "xenon",
    "yarrow",
    "zephyr",
    "alder",
    "basalt",
    "cedar",
    "delta",
    "elm",
    "flint",
]
PASSAGE_CHARS = 12_000


@dataclass(frozen=True)
class Secret:
    codename: str
    code: str

    @property
    def sentence(self) -> str:
        return f" The vault code of the {self.codename} archive is {self.code}. "

    @property
    def question(self) -> str:
        return f"What is the vault code of the {self.codename} archive?"


def secrets_for(n: int, seed: int = 0) -> list[Secret]:
    rng = random.Random(seed)
    codes: set[str] = set()
    while len(codes) < n:
        codes.add("".join(rng.choices(string.ascii_uppercase, k=2)) + "-" + "".join(rng.choices(string.digits, k=4)))
    return [
        Secret(CODENAMES[i % len(CODENAMES)] + (str(i // len(CODENAMES)) if i >= len(CODENAMES) else ""), code)
        for i, code in enumerate(sorted(codes))
    ]


def passage(index: int, secret: Secret) -> str:
    """A stretch of the book, different for each session, with the secret in its middle."""
    book = BOOK.read_text(encoding="utf-8")
    start = (index * 9_001) % (len(book) - PASSAGE_CHARS)
    text = book[start : start + PASSAGE_CHARS]
    middle = text.find(". ", PASSAGE_CHARS // 2) + 1
    return text[:middle] + secret.sentence + text[middle:]


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)
    leaks: list[str] = field(default_factory=list)
    asks: int = 0
    right: int = 0
    hangups: int = 0
    stream_errors: list[str] = field(default_factory=list)


async def call(client: httpx.AsyncClient, tally: Tally, method: str, path: str, **kwargs) -> httpx.Response:
    """One request, retried after Retry-After on 429."""
    for _ in range(60):
        response = await client.request(method, path, **kwargs)
        tally.statuses[response.status_code] += 1
        if response.status_code != 429:
            return response
        await asyncio.sleep(float(response.headers.get("retry-after", "1")))
    return response


async def stream_events(client: httpx.AsyncClient, tally: Tally, path: str, body: dict, stop_after_delta: bool = False):
    """(event, data) pairs of a streamed request, retried on 429; hangs up after the first delta if asked."""
    for _ in range(60):
        async with client.stream("POST", path, json=body) as response:
            tally.statuses[response.status_code] += 1
            if response.status_code == 429:
                await response.aread()
                await asyncio.sleep(float(response.headers.get("retry-after", "1")))
                continue
            events, name = [], "message"
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    data = line[5:].strip()
                    events.append((name, json.loads(data) if data != "[DONE]" else data))
                    if name == "error":
                        tally.stream_errors.append(data)
                    if stop_after_delta and (name == "delta" or (name == "message" and '"content"' in data and len(events) > 1)):
                        tally.hangups += 1
                        return events  # leaving the block closes the connection mid-stream
                    name = "message"
            return events
    raise RuntimeError("still 429 after 60 tries")


def check_answer(
    tally: Tally, index: int, answer: str, items: list[dict], own_documents: set[str], secrets: list[Secret]
) -> None:
    tally.asks += 1
    tally.right += secrets[index].code in answer
    for other, secret in enumerate(secrets):
        if other != index and secret.code in answer:
            tally.leaks.append(f"session {index}'s answer holds session {other}'s code {secret.code}")
    for item in items:
        if item["document_id"] not in own_documents:
            tally.leaks.append(f"session {index} retrieved document {item['document_id']}, not its own")


async def one_session(server: Server, tally: Tally, index: int, key: str, secrets: list[Secret], made: dict) -> None:
    secret = secrets[index]
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=600) as client:
        created = await call(client, tally, "POST", "/v1/sessions", json={"memory": "text"})
        session_id = created.json()["id"]
        made.setdefault(key, set()).add(session_id)
        url = f"/v1/sessions/{session_id}"
        if index % 2:
            events = await stream_events(client, tally, f"{url}/documents?stream=true", {"text": passage(index, secret)})
            document_id = events[-1][1]["id"]
        else:
            document_id = (await call(client, tally, "POST", f"{url}/documents", json={"text": passage(index, secret)})).json()[
                "id"
            ]
        body = {"question": secret.question, "max_tokens": 24}
        plain = (await call(client, tally, "POST", f"{url}/ask", json=body)).json()
        check_answer(tally, index, plain["answer"], plain["retrieval"]["items"], {document_id}, secrets)
        events = await stream_events(client, tally, f"{url}/ask", {**body, "stream": True})
        streamed = "".join(data["text"] for name, data in events if name == "delta")
        items = next(data["items"] for name, data in events if name == "retrieval")
        check_answer(tally, index, streamed, items, {document_id}, secrets)
        chat = {
            "messages": [{"role": "user", "content": secret.question}],
            "session_id": session_id,
            "max_tokens": 24,
            "stream": True,
        }
        await stream_events(client, tally, "/v1/chat/completions", chat, stop_after_delta=True)


async def run_load(server: Server, keys: list[str], sessions: int) -> dict:
    tally = Tally()
    made: dict[str, set[str]] = {}  # API key -> the sessions made with it
    secrets = secrets_for(sessions)
    rss_before = server.rss_bytes()
    started = time.perf_counter()
    await asyncio.gather(*(one_session(server, tally, i, keys[i % len(keys)], secrets, made) for i in range(sessions)))
    seconds = time.perf_counter() - started
    rss_loaded = server.rss_bytes()
    # each key sees its own sessions and no other
    foreign = 0
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        for key, own in made.items():
            listed = (await client.get("/v1/sessions", headers={"Authorization": f"Bearer {key}"})).json()["data"]
            foreign += len({s["id"] for s in listed} ^ own)
        deadline = time.monotonic() + 60
        while server.metric("longdoc_queue_depth") > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        queue_after = server.metric("longdoc_queue_depth")
        for key, own in made.items():
            for session_id in own:
                await client.delete(f"/v1/sessions/{session_id}", headers={"Authorization": f"Bearer {key}"})
    return {
        "sessions": sessions,
        "keys": len(keys),
        "requests": sum(tally.statuses.values()),
        "statuses": dict(sorted(tally.statuses.items())),
        "server_errors": sum(n for status, n in tally.statuses.items() if status >= 500),
        "stream_errors": tally.stream_errors,
        "leaks": tally.leaks,
        "foreign_sessions_listed": foreign,
        "answers_with_own_code": f"{tally.right}/{tally.asks}",
        "hangups": tally.hangups,
        "queue_depth_after": queue_after,
        "session_memory_bytes_after": server.metric("longdoc_session_memory_bytes"),
        "reserved_bytes_after": server.metric("longdoc_session_memory_reserved_bytes"),
        "rss_before_mib": round(rss_before / 2**20, 1),
        "rss_loaded_mib": round(rss_loaded / 2**20, 1),
        "rss_after_mib": round(server.rss_bytes() / 2**20, 1),
        "seconds": round(seconds, 1),
        "alive": server.alive(),
    }


def load_passed(result: dict) -> bool:
    return (
        result["server_errors"] == 0
        and not result["leaks"]
        and not result["stream_errors"]
        and result["foreign_sessions_listed"] == 0
        and result["queue_depth_after"] == 0
        and result["session_memory_bytes_after"] == 0
        and result["reserved_bytes_after"] == 0
        and result["alive"]
    )
