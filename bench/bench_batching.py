"""Concurrent answers through the HTTP API, unbatched (`max_batch` 1: each answer steps alone,
interleaved) against batched (`max_batch` 8, and with `--quantize bf16` and `int8`), in one run on the same
machine: per-stream TTFT and decode tok/s, and all output tokens / wall time, for 1, 4 and 8
streams at once.

    make bench-batching   # or: .venv/bin/python -m bench.bench_batching [--max-tokens 96] [--window 512]

Each stream asks its own `truncate` session holding the last `--window` tokens of Alice, so every
prompt is about that long; answers are greedy, at most max_tokens tokens (one may end earlier at
the model's end token: the rates count the tokens produced).
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from clients.client import LongdocClient
from engine.config import SMALL_MODEL
from scripts.drills.server import Server

BOOK = Path("tests/fixtures/alice29.txt")

QUESTIONS = [  # each asks for a long answer, so that decoding, not the prompt, takes the time
    "Retell this passage in detail, event by event.",
    "Describe every character in this passage at length.",
    "Write a long summary of this passage, paragraph by paragraph.",
    "Explain in detail everything that happens at the trial.",
]


def timed_answer(client: LongdocClient, session: str, question: str, max_tokens: int) -> tuple[float, float, int]:
    """(TTFT s, decode tok/s after the first token, output tokens), on the client side."""
    started = time.perf_counter()
    first = done = None
    for event in client.ask_stream(session, question, max_tokens=max_tokens, temperature=0):
        if event.event == "delta" and first is None:
            first = time.perf_counter()
        elif event.event == "done":
            done = event.data
    end = time.perf_counter()
    assert done is not None and first is not None, "no answer streamed"
    tokens = done["usage"]["completion_tokens"]
    return first - started, (tokens - 1) / (end - first) if tokens > 1 else float("nan"), tokens


def streams_at_once(url: str, sessions: list[str], max_tokens: int) -> tuple[float, float, float, list[int]]:
    """(median TTFT s, median per-stream decode tok/s, all output tokens / wall s, each answer's tokens)."""
    client = LongdocClient(url)
    started = time.perf_counter()
    with ThreadPoolExecutor(len(sessions)) as pool:
        results = list(
            pool.map(lambda i: timed_answer(client, sessions[i], QUESTIONS[i % len(QUESTIONS)], max_tokens), range(len(sessions)))
        )
    wall = time.perf_counter() - started
    produced = sum(tokens for *_, tokens in results)
    return (
        statistics.median(r[0] for r in results),
        statistics.median(r[1] for r in results),
        produced / wall,
        [r[2] for r in results],
    )


def bench(
    env: dict[str, str], stream_counts: list[int], max_tokens: int, window: int
) -> list[tuple[int, float, float, float, list[int]]]:
    server = Server(["--model", SMALL_MODEL, "--device", "cpu", "--dtype", "float32"], env=env).start()
    try:
        client = LongdocClient(server.url)
        book = BOOK.read_text(encoding="utf-8")
        sessions = []
        for _ in range(max(stream_counts)):
            session = client.create_session(memory="truncate", options={"window_tokens": window})["id"]
            client.add_document(session, book, name="alice")
            sessions.append(session)
        timed_answer(client, sessions[0], QUESTIONS[0], 8)  # warm-up
        rows = []
        for count in stream_counts:
            ttft, decode, total, tokens = streams_at_once(server.url, sessions[:count], max_tokens)
            print(
                f"  {env}, {count} streams: TTFT {ttft:.2f} s, decode {decode:.1f} tok/s a stream, "
                f"{total:.1f} tok/s in all, answers of {tokens} tokens",
                flush=True,
            )
            rows.append((count, ttft, decode, total, tokens))
        return rows
    finally:
        server.stop()


CONFIGS = {  # name: server environment
    "unbatched (max_batch 1)": {"LONGDOC_MAX_BATCH": "1"},
    "batched (max_batch 8)": {"LONGDOC_MAX_BATCH": "8"},
    "batched, --quantize int8": {"LONGDOC_MAX_BATCH": "8", "LONGDOC_QUANTIZE": "int8"},
    "batched, --quantize bf16": {"LONGDOC_MAX_BATCH": "8", "LONGDOC_QUANTIZE": "bf16"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--window", type=int, default=512)
    args = parser.parse_args()
    results = {name: bench(env, args.streams, args.max_tokens, args.window) for name, env in CONFIGS.items()}
    unbatched = results["unbatched (max_batch 1)"]
    print(
        "\n| server | streams | TTFT s (median) | decode tok/s a stream (median) | output tok/s in all | in all vs its 1 stream | in all vs unbatched | answers (tokens) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        for (count, ttft, decode, total, tokens), base in zip(rows, unbatched, strict=True):
            print(
                f"| {name} | {count} | {ttft:.2f} | {decode:.1f} | {total:.1f} | {total / rows[0][3]:.2f}x | {total / base[3]:.2f}x | {tokens} |"
            )


if __name__ == "__main__":
    main()
