"""The second question of a session (issue 62): how much sooner its first token comes than the
first question's, with the session's last prompt kept (`prefix_cache_tokens`) and without.

Each pair of consecutive QA-benchmark questions on a text gets a session of its own holding that
text; the pair is asked in order (streamed, greedy, `max_tokens` each) on a server with the prefix
cache and on one without (`--prefix-cache-tokens 0`), both on the default model and otherwise
default settings; then the second question once more (a regenerated answer: the same prompt).
Reports per server the first token of each session's first and second question and of the repeat
(the server's own `ttft_seconds`, medians), the median of each session's ratio second / first, and
the prompt tokens the cache took instead of feeding (/metrics).
"""

from __future__ import annotations

import asyncio
import json
import statistics

import httpx

from research.evals.qa import DEV_QUESTIONS, QUESTIONS, load_questions
from research.evals.texts import load
from scripts.drills.server import Server


async def _ask(client: httpx.AsyncClient, session: str, question: str, max_tokens: int) -> dict:
    body = {"question": question, "stream": True, "max_tokens": max_tokens, "temperature": 0}
    done: dict = {}
    async with client.stream("POST", f"/v1/sessions/{session}/ask", json=body) as response:
        response.raise_for_status()
        name = ""
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: ") and name in ("done", "error"):
                done = {"event": name, **json.loads(line[6:])}
    if done.get("event") != "done":
        raise RuntimeError(f"the answer failed: {json.dumps(done)[:300]}")
    return {"ttft": done["timings"]["ttft_seconds"], "prompt_tokens": done["usage"]["prompt_tokens"]}


def pairs(dev: bool, per_text: int) -> list[tuple[str, str, str]]:
    """(text, first question, second question): each text's first `per_text` pairs in file order."""
    by_text: dict[str, list[str]] = {}
    for question in load_questions(DEV_QUESTIONS if dev else QUESTIONS):
        by_text.setdefault(question.text, []).append(question.question)
    chosen = []
    for text, questions in by_text.items():
        chosen += [(text, questions[2 * i], questions[2 * i + 1]) for i in range(min(per_text, len(questions) // 2))]
    return chosen


async def _sessions(server: Server, asked: list[tuple[str, str, str]], max_tokens: int) -> list[dict]:
    rows = []
    async with httpx.AsyncClient(base_url=server.url, timeout=3600) as client:
        for text, first, second in asked:
            session = (await client.post("/v1/sessions", json={"memory": "text"})).json()["id"]
            response = await client.post(f"/v1/sessions/{session}/documents", json={"text": load(text), "name": text})
            response.raise_for_status()
            one, two = await _ask(client, session, first, max_tokens), await _ask(client, session, second, max_tokens)
            again = await _ask(client, session, second, max_tokens)
            rows.append({"text": text, "first": one, "second": two, "again": again, "ratio": two["ttft"] / one["ttft"]})
            await client.delete(f"/v1/sessions/{session}")
    return rows


def _summary(rows: list[dict], reused: float, hits: float) -> dict:
    return {
        "sessions": len(rows),
        "first_ttft_median_s": round(statistics.median(r["first"]["ttft"] for r in rows), 3),
        "second_ttft_median_s": round(statistics.median(r["second"]["ttft"] for r in rows), 3),
        "second_over_first_median": round(statistics.median(r["ratio"] for r in rows), 3),
        "again_ttft_median_s": round(statistics.median(r["again"]["ttft"] for r in rows), 3),
        "prompt_tokens_median": statistics.median(r[k]["prompt_tokens"] for r in rows for k in ("first", "second")),
        "prefix_hits": hits,
        "prefix_reused_tokens": reused,
        "rows": rows,
    }


def run_second(model: str, dev: bool, per_text: int, max_tokens: int) -> dict:
    asked = pairs(dev, per_text)
    results: dict = {}
    for name, args in (("kept", []), ("none", ["--prefix-cache-tokens", "0"])):
        server = Server(args, env={"LONGDOC_MODEL": model}).start(timeout=1800)
        try:
            asyncio.run(_sessions(server, asked[:1], 4))  # warm: the first answer's one-time costs
            hits, reused = (
                server.metric("longdoc_prefix_cache_hits_total"),
                server.metric("longdoc_prefix_cache_reused_tokens_total"),
            )
            rows = asyncio.run(_sessions(server, asked, max_tokens))
            hits = server.metric("longdoc_prefix_cache_hits_total") - hits
            reused = server.metric("longdoc_prefix_cache_reused_tokens_total") - reused
            results[name] = _summary(rows, reused, hits)
        finally:
            server.stop()
    pairs_of = zip(results["kept"]["rows"], results["none"]["rows"], strict=True)
    ratios = [kept["second"]["ttft"] / none["second"]["ttft"] for kept, none in pairs_of]
    results["second_kept_over_none_median"] = round(statistics.median(ratios), 3)  # the same question, cache on / off
    results["dev"] = dev
    return results


def second_passed(result: dict) -> bool:
    """Every answer came (a failed one raises); the cache was used where it was on and not where off."""
    return result["kept"]["prefix_hits"] > 0 and result["none"]["prefix_hits"] == 0
