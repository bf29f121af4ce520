"""Answers per minute through the HTTP API with 1 and 2 Ray Serve replicas, against `longdoc serve`
alone, and what the ingress hop adds to a request, in one run on this machine.

    make bench-scaleout   # or: .venv/bin/python -m bench.bench_scaleout [--seconds 60] [--clients 8]

Each client thread asks its own `text` session (a slice of Alice) a question after another, greedy,
at most --max-tokens tokens, for --seconds; answers per minute count the answers finished. The
routing figure is the median time of `GET /v1/sessions/{id}` (no model work), one at a time.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from engine.config import SMALL_MODEL
from scripts.drills.server import Server

BOOK = Path("tests/fixtures/alice29.txt")
QUESTION = "What happens in this part of the story?"
SLICE_CHARS = 6000
ROUTING_REQUESTS = 200

CONFIGS = {  # name: (command, arguments)
    "longdoc serve": ("serve", []),
    "serve-ray, 1 replica (2 CPUs)": ("serve-ray", ["--replicas", "1", "--replica-cpus", "2"]),
    "serve-ray, 2 replicas (1 CPU each)": ("serve-ray", ["--replicas", "2", "--replica-cpus", "1"]),
}


def make_sessions(url: str, count: int) -> list[str]:
    book = BOOK.read_text(encoding="utf-8")
    step = (len(book) - SLICE_CHARS) // count
    sessions = []
    for i in range(count):
        session = httpx.post(f"{url}/v1/sessions", json={"memory": "text"}, timeout=60).json()["id"]
        text = book[i * step : i * step + SLICE_CHARS]
        httpx.post(f"{url}/v1/sessions/{session}/documents", json={"text": text}, timeout=300).raise_for_status()
        sessions.append(session)
    return sessions


def ask(url: str, session: str, max_tokens: int) -> None:
    body = {"question": QUESTION, "max_tokens": max_tokens, "temperature": 0}
    httpx.post(f"{url}/v1/sessions/{session}/ask", json=body, timeout=600).raise_for_status()


def routing_ms(url: str, session: str) -> tuple[float, float]:
    """(median, 90th percentile) ms of a session GET."""
    times = []
    with httpx.Client() as client:
        for _ in range(ROUTING_REQUESTS):
            started = time.perf_counter()
            client.get(f"{url}/v1/sessions/{session}").raise_for_status()
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), statistics.quantiles(times, n=10)[-1]


def answers_per_minute(url: str, sessions: list[str], seconds: float, max_tokens: int) -> float:
    deadline = time.monotonic() + seconds
    done, lock = [0], threading.Lock()

    def client(session: str) -> None:
        while time.monotonic() < deadline:
            ask(url, session, max_tokens)
            with lock:
                done[0] += 1

    started = time.perf_counter()
    with ThreadPoolExecutor(len(sessions)) as pool:
        list(pool.map(client, sessions))
    return done[0] / (time.perf_counter() - started) * 60


def bench(command: str, args: list[str], clients: int, seconds: float, max_tokens: int) -> tuple[float, float, float]:
    server = Server(["--model", SMALL_MODEL, *args], command=command, log=Path(f"/tmp/longdoc-bench-{command}.log"))
    server.start()
    try:
        sessions = make_sessions(server.url, clients)
        for session in sessions:  # warm-up
            ask(server.url, session, 4)
        median, p90 = routing_ms(server.url, sessions[0])
        rate = answers_per_minute(server.url, sessions, seconds, max_tokens)
        return median, p90, rate
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    results = {}
    for name, (command, extra) in CONFIGS.items():
        results[name] = bench(command, extra, args.clients, args.seconds, args.max_tokens)
        print(f"  {name}: {results[name]}", flush=True)
    base_ms, _, base_rate = results["longdoc serve"]
    print("\n| server | session GET ms (median) | p90 | added by the ingress (median) | answers/min | vs longdoc serve |")
    print("|---|---|---|---|---|---|")
    for name, (median, p90, rate) in results.items():
        print(f"| {name} | {median:.1f} | {p90:.1f} | {median - base_ms:+.1f} | {rate:.1f} | {rate / base_rate:.2f}x |")


if __name__ == "__main__":
    main()
