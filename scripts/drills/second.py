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

import statistics

from clients.client import LongdocClient
from research.evals.qa import DEV_QUESTIONS, QUESTIONS, load_questions
from research.evals.texts import load
from scripts.drills.server import Server


def _ask(client: LongdocClient, session: str, question: str, max_tokens: int) -> dict:
    """One streamed question: the server's first-token time and the prompt's tokens."""
    events = list(client.ask_stream(session, question, max_tokens=max_tokens, temperature=0))
    done = events[-1]
    if done.event != "done":
        raise RuntimeError(f"the answer failed: {str(done.data)[:300]}")
    return {"ttft": done.data["timings"]["ttft_seconds"], "prompt_tokens": done.data["usage"]["prompt_tokens"]}


def pairs(dev: bool, per_text: int) -> list[tuple[str, str, str]]:
    """(text, first question, second question): each text's first `per_text` pairs in file order."""
    by_text: dict[str, list[str]] = {}
    for question in load_questions(DEV_QUESTIONS if dev else QUESTIONS):
        by_text.setdefault(question.text, []).append(question.question)
    chosen = []
    for text, questions in by_text.items():
        chosen += [(text, questions[2 * i], questions[2 * i + 1]) for i in range(min(per_text, len(questions) // 2))]
    return chosen


def _sessions(server: Server, asked: list[tuple[str, str, str]], max_tokens: int) -> list[dict]:
    rows = []
    client = LongdocClient(server.url, timeout=3600)
    try:
        for text, first, second in asked:
            session = client.create_session(memory="text")["id"]
            client.add_document(session, load(text), name=text)
            one, two = _ask(client, session, first, max_tokens), _ask(client, session, second, max_tokens)
            again = _ask(client, session, second, max_tokens)
            rows.append({"text": text, "first": one, "second": two, "again": again, "ratio": two["ttft"] / one["ttft"]})
            client.delete_session(session)
    finally:
        client.close()
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
            _sessions(server, asked[:1], 4)  # warm: the first answer's one-time costs
            hits, reused = (
                server.metric("longdoc_prefix_cache_hits_total"),
                server.metric("longdoc_prefix_cache_reused_tokens_total"),
            )
            rows = _sessions(server, asked, max_tokens)
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
