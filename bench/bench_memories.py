"""Serving benchmark per memory mode on SmolLM2-135M (or the served model `--model` names), through the real HTTP server.

For a long document (default: Paradise Lost, ~132k tokens) and each memory mode: ingestion
tokens/s, then warm questions streamed over SSE: time to first token, decode tokens/s
(vLLM's TPOT = (E2E - TTFT) / (output tokens - 1)), and whether the answers to questions about
the middle of the book are correct. Medians over warm runs; ratios against `truncate` from the
same run. Prints a Markdown table and writes it to docs/benchmarks.md.

    make bench                      # or: .venv/bin/python -m bench.bench_memories --repeats 5
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from clients.client import LongdocClient
from engine.config import SMALL_MODEL
from research.evals.docs import write_section
from research.training.corpus import fetch

ROOT = Path(__file__).resolve().parents[1]

# Questions about passages 36-43% of the way into Paradise Lost, with the word a correct answer names.
MIDDLE_QUESTIONS = (
    ("Which angel did Heaven's King send to converse with Adam and warn him?", "Raphael"),
    ("Which seraph stayed faithful to God among the rebel angels?", "Abdiel"),
)
WARM_QUESTION = "Who is the speaker at the start of the poem?"


@dataclass
class Row:
    memory: str
    tokens: int
    ingest_seconds: float
    ttft: float
    decode_tps: float
    prompt_tokens: int
    correct: int
    asked: int
    sdk_correct: int
    batched_tps: dict[int, float]  # streams asked at once: output tokens/s of all of them together


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int, model: str = SMALL_MODEL) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "clients.cli", "serve", "--port", str(port), "--log-level", "warning", "--model", model]
    process = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:  # it failed to start (an import, a bad setting): no use waiting out the deadline
            raise RuntimeError(f"the server exited with status {process.returncode} before it was ready")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError("server did not become ready")


def timed_ask(client: LongdocClient, session: str, question: str, max_tokens: int) -> tuple[float, float, int, str]:
    """(TTFT, decode tokens/s, prompt tokens, answer) measured on the client side."""
    started = time.perf_counter()
    first = None
    text, done = [], None
    for event in client.ask_stream(session, question, max_tokens=max_tokens):
        if event.event == "delta":
            first = first or time.perf_counter()
            text.append(event.data["text"])
        elif event.event == "done":
            done = event.data
    end = time.perf_counter()
    assert done is not None and first is not None, "no answer streamed"
    out_tokens = done["usage"]["completion_tokens"]
    decode = (out_tokens - 1) / (end - first) if out_tokens > 1 and end > first else float("nan")
    return first - started, decode, done["usage"]["prompt_tokens"], "".join(text)


def bench_memory(base_url: str, memory: str, text: str, repeats: int, max_tokens: int, streams: list[int]) -> Row:
    client = LongdocClient(base_url)
    session = client.create_session(memory=memory)["id"]
    started = time.perf_counter()
    document = client.add_document(session, text, name="book")
    ingest_seconds = time.perf_counter() - started
    timed_ask(client, session, WARM_QUESTION, max_tokens)  # warm-up
    ttfts, decodes, prompts = [], [], []
    correct = 0
    for i in range(repeats):
        question, expected = MIDDLE_QUESTIONS[i % len(MIDDLE_QUESTIONS)]
        ttft, decode, prompt_tokens, answer = timed_ask(client, session, question, max_tokens)
        ttfts.append(ttft)
        decodes.append(decode)
        prompts.append(prompt_tokens)
        correct += expected.lower() in answer.lower()
        print(f"  [{memory}] {question} -> {answer.strip()!r}", flush=True)
    sdk_correct = openai_answers(base_url, session, max_tokens)
    batched = {n: concurrent_tps(client, session, n, max_tokens) for n in streams if n > 1}
    client.delete_session(session)
    return Row(
        memory,
        document["tokens"],
        ingest_seconds,
        statistics.median(ttfts),
        statistics.median(decodes),
        int(statistics.median(prompts)),
        correct,
        repeats,
        sdk_correct,
        batched,
    )


def concurrent_tps(client: LongdocClient, session: str, streams: int, max_tokens: int) -> float:
    """`streams` questions asked at once on one session: all output tokens / wall time. Each answer
    runs `max_tokens` (`ignore_eos`; the repetition guard can still end one): real answers to these
    questions are a few tokens, and their time would be the prompts', not decoding's."""
    questions = [MIDDLE_QUESTIONS[i % len(MIDDLE_QUESTIONS)][0] for i in range(streams)]
    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda q: client.ask(session, q, max_tokens=max_tokens, ignore_eos=True), questions))
    wall = time.perf_counter() - started
    return sum(r["usage"]["completion_tokens"] for r in results) / wall


def openai_answers(base_url: str, session: str, max_tokens: int) -> int:
    """Ask the middle-of-book questions again through the official openai SDK, streamed."""
    from openai import OpenAI

    sdk = OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    correct = 0
    for question, expected in MIDDLE_QUESTIONS:
        stream = sdk.chat.completions.create(
            model=sdk.models.list().data[0].id,
            messages=[{"role": "user", "content": question}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"session_id": session},
        )
        answer = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        correct += expected.lower() in answer.lower()
        print(f"  [openai sdk, session {session}] {question} -> {answer.strip()!r}", flush=True)
    return correct


def table(rows: list[Row]) -> str:
    base = rows[0]
    lines = [
        "| memory | document tokens | ingest tok/s | TTFT median (s) | decode tok/s median | prompt tokens | "
        "middle-of-book answers correct (REST) | (openai SDK) | TTFT vs truncate | decode vs truncate | "
        "output tok/s, streams at once (answers of max-tokens) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        batched = "; ".join(f"{tps:.1f} ({n} streams)" for n, tps in r.batched_tps.items()) or "not measured"
        lines.append(
            f"| {r.memory} | {r.tokens} | {r.tokens / r.ingest_seconds:,.0f} | {r.ttft:.2f} | {r.decode_tps:.1f} | "
            f"{r.prompt_tokens} | {r.correct}/{r.asked} | {r.sdk_correct}/{len(MIDDLE_QUESTIONS)} | {r.ttft / base.ttft:.2f}x | "
            f"{r.decode_tps / base.decode_tps:.2f}x | {batched} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--document", type=Path, default=None, help="default: Paradise Lost from the corpus")
    parser.add_argument("--memories", nargs="+", default=["truncate", "text"])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--streams", type=int, nargs="+", default=[1], help="also ask this many questions at once, each count in turn (1: skip)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--model", default=SMALL_MODEL, help="the served model, by name")
    args = parser.parse_args()
    document = args.document or fetch(ROOT / "data" / "corpus") / "plrabn12.txt"
    text = document.read_text(encoding="utf-8")
    port = free_port()
    server = start_server(port, args.model)
    try:
        base_url = f"http://127.0.0.1:{port}"
        rows = []
        for memory in args.memories:
            rows.append(bench_memory(base_url, memory, text, args.repeats, args.max_tokens, args.streams))
            print(table(rows).splitlines()[-1], flush=True)  # each row as it is measured
    finally:
        server.terminate()
        server.wait(30)
    result = table(rows)
    print(result)
    command = "make bench  # .venv/bin/python -m bench.bench_memories " + " ".join(sys.argv[1:])
    machine, where = machine_description()
    title = "SmolLM2-135M-Instruct" if args.model == SMALL_MODEL else args.model  # the small model's sections keep their headings
    section = (
        f"## Memory modes on {title}{where}\n\n"
        f"Document: `{document.name}`. Machine: {machine}. Command:\n\n```\n{command.strip()}\n```\n\n"
        f"{result}\n\nTTFT is measured by the client from sending the question to the first streamed text; "
        "decode tokens/s = (output tokens - 1) / (E2E - TTFT). Medians over warm runs (one warm-up "
        "question first). Ratios are against `truncate` in the same run. The questions ask about "
        "passages 36% and 43% into the book (Raphael sent to warn Adam; the seraph Abdiel); an answer "
        "counts as correct when it names them. The answers are printed while the benchmark runs.\n"
    )
    write_section(args.out, section)


def machine_description() -> tuple[str, str]:
    """(the machine in words, a heading suffix: empty on CPU so the CPU section keeps its place)."""
    import torch

    if not torch.cuda.is_available():
        return f"{os.cpu_count()} CPU cores, no GPU", ""
    name = torch.cuda.get_device_name()
    return f"{name}, torch {torch.__version__}, {os.cpu_count()} CPU cores", f", on GPU ({name})"


if __name__ == "__main__":
    main()
