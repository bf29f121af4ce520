"""Capacity (issue 62): many people asking at once on the default model and default settings.

Each of N sessions holds a short passage of its own; all N ask at once (streamed, `max_tokens`
new tokens each, the answer's length forced with `ignore_eos`), and no refusal is retried. Then one
stream alone and `streams` streams together give the aggregate decode rate (while all of them
decode, as bench/peers.py counts it, and over the wave's wall time), in `rounds` rounds of one
then many, so that the machine's drift falls on both alike: the ratio is the median of the
rounds' ratios (the later rounds' prompts come from the prefix cache). Reports refusals,
completions, TTFT (median and p95), decode rates and what /metrics says of key/value blocks,
waiting answers and preemptions; passes when nothing is refused and every answer completes.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx

from scripts.drills.server import Server
from scripts.drills.streams import decode_while_all

PASSAGE_CHARS = 3_000  # with the question and template, a prompt of about 700 tokens on the default model
QUESTION = "Summarise what this passage says, in order, with every name it gives."


async def _make_sessions(client: httpx.AsyncClient, book: str, count: int) -> list[str]:
    sessions = []
    for i in range(count):
        session = (await client.post("/v1/sessions", json={"memory": "text"})).json()["id"]
        start = (i * PASSAGE_CHARS * 3) % max(1, len(book) - PASSAGE_CHARS)
        passage = book[start : start + PASSAGE_CHARS]
        response = await client.post(f"/v1/sessions/{session}/documents", json={"text": passage, "name": f"part-{i}.txt"})
        response.raise_for_status()
        sessions.append(session)
    return sessions


async def _ask(client: httpx.AsyncClient, session: str, max_tokens: int) -> dict:
    """One streamed question: its status, TTFT, tokens, decode seconds and prompt tokens."""
    started = time.perf_counter()
    body = {"question": QUESTION, "stream": True, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    times: list[float] = []  # when each text delta came
    async with client.stream("POST", f"/v1/sessions/{session}/ask", json=body) as response:
        if response.status_code != 200:
            return {"status": response.status_code, "error": (await response.aread()).decode()[:300]}
        done: dict = {}
        name = ""
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                if name == "delta":
                    times.append(time.perf_counter())
                elif name in ("done", "error"):
                    done = {"event": name, **json.loads(line[6:])}
    ended = time.perf_counter()
    if done.get("event") != "done" or not times:
        return {"status": 200, "error": json.dumps(done)[:300]}
    return {
        "status": 200,
        "ttft": times[0] - started,
        "tokens": done["usage"]["completion_tokens"],
        "decode_seconds": ended - times[0],
        "prompt_tokens": done["usage"]["prompt_tokens"],
        "times": times,
    }


async def _wave(client: httpx.AsyncClient, sessions: list[str], max_tokens: int) -> list[dict]:
    return list(await asyncio.gather(*(_ask(client, s, max_tokens) for s in sessions)))


def _p95(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.95 * len(values)) - 1)] if values else float("nan")


def _summary(results: list[dict]) -> dict:
    done = [r for r in results if "ttft" in r]
    return {
        "asked": len(results),
        "refused": sum(r["status"] == 429 for r in results),
        "failed": len(results) - len(done),
        "completed": len(done),
        "statuses": sorted({r["status"] for r in results}),
        "errors": [r["error"] for r in results if "error" in r][:3],
        "ttft_median_s": round(statistics.median(r["ttft"] for r in done), 2) if done else None,
        "ttft_p95_s": round(_p95([r["ttft"] for r in done]), 2) if done else None,
        "prompt_tokens_median": statistics.median(r["prompt_tokens"] for r in done) if done else None,
    }


def _decode_while_all(results: list[dict]) -> float | None:
    """Tokens per second, all streams together, while every one of them decodes (streams.py)."""
    rate = decode_while_all([(r["times"], r["tokens"]) for r in results if "ttft" in r])
    return None if rate is None else round(rate, 2)


def _single(one: list[dict]) -> float | None:
    """One stream's decode rate: its tokens after the first over the time after the first (None
    if it failed)."""
    return round((one[0]["tokens"] - 1) / one[0]["decode_seconds"], 2) if "ttft" in one[0] else None


def _median(values: list[float | None]) -> float | None:
    """The median of the values measured (None where none was)."""
    measured = [v for v in values if v is not None]
    return round(statistics.median(measured), 2) if measured else None


async def _one_then_many(client: httpx.AsyncClient, sessions: list[str], max_tokens: int) -> dict:
    """One round: one stream alone, then every session's stream at once."""
    one = await _wave(client, sessions[:1], max_tokens)
    single = _single(one)
    started = time.perf_counter()
    many = await _wave(client, sessions, max_tokens)
    seconds = time.perf_counter() - started
    aggregate = _decode_while_all(many)
    done = [r for r in many if "ttft" in r]
    return {
        "single": _summary(one),
        "single_stream_tok_s": single,
        "streams": _summary(many)
        | {
            "count": len(sessions),
            "decode_while_all_tok_s": aggregate,
            "tokens_per_wall_second": round(sum(r["tokens"] for r in done) / seconds, 2),  # prefills included
        },
        "streams_over_single": round(aggregate / single, 2) if aggregate and single else None,
    }


async def run_capacity(server: Server, book: str, people: int, streams: int, max_tokens: int, rounds: int = 3) -> dict:
    if rounds < 1:
        raise ValueError("the capacity drill needs at least one round")
    async with httpx.AsyncClient(base_url=server.url, timeout=3600) as client:
        sessions = await _make_sessions(client, book, max(people, streams))
        await _wave(client, sessions[:1], 8)  # warm
        rss_before = server.rss_bytes()
        started = time.perf_counter()
        crowd = await _wave(client, sessions[:people], max_tokens)
        crowd_seconds = time.perf_counter() - started
        preemptions = server.metric("longdoc_kv_preemptions_total")
        measured = [await _one_then_many(client, sessions[:streams], max_tokens) for _ in range(rounds)]
        for session in sessions:
            await client.delete(f"/v1/sessions/{session}")
    return {
        "people": _summary(crowd) | {"seconds": round(crowd_seconds, 1), "kv_preemptions": preemptions},
        "rss_growth_mib": round((server.rss_bytes() - rss_before) / 2**20, 1),
        # medians over the rounds: the ratio is the median of the rounds' ratios, not of these two
        "single_stream_tok_s": _median([m["single_stream_tok_s"] for m in measured]),
        "streams": measured[0]["streams"],  # the first round's (its prompts are kept only if the crowd asked them)
        "rounds": measured,
        "streams_over_single": _median([m["streams_over_single"] for m in measured]),
        "kv_blocks_after": server.metric("longdoc_kv_blocks"),
        "waiting_after": server.metric("longdoc_batch_waiting"),
        "alive": server.alive(),
    }


def capacity_passed(result: dict) -> bool:
    people = result["people"]
    waves = [wave for r in result["rounds"] for wave in (r["single"], r["streams"])]
    return (
        people["refused"] == people["failed"] == 0
        and all(wave["refused"] == wave["failed"] == 0 for wave in waves)
        and result["kv_blocks_after"] == 0
        and result["alive"]
    )
