"""Does a remembered turn help a later question? Measured through a running server's REST API.

For each key, two neurocache sessions (SmolLM2-135M, the adapter's model) take the same book, then two turns: first "The
pass key is NNNNN. Remember it. Say OK.", then, as a new question, "What is the pass key?". One
session is made with `{"options": {"remember": true}}`, so its first turn is written into its
cache; the other only reads its cache. The second answer counts when it holds the key. Greedy.

    make serve ARGS="--port 8126 --model smollm2-135m-instruct" &
    .venv/bin/python -m bench.neurocache_remember --url http://127.0.0.1:8126 [--keys 48213 73906 ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "tests" / "fixtures" / "alice29.txt"


def second_answer(client: httpx.Client, book: str, key: str, remember: bool) -> str:
    session = client.post("/v1/sessions", json={"memory": "neurocache", "options": {"remember": remember}}).json()["id"]
    try:
        client.post(f"/v1/sessions/{session}/documents", json={"text": book, "name": "book"}).raise_for_status()
        greedy = {"max_tokens": 20, "temperature": 0}
        client.post(f"/v1/sessions/{session}/ask", json={"question": f"The pass key is {key}. Remember it. Say OK.", **greedy})
        answer = client.post(f"/v1/sessions/{session}/ask", json={"question": "What is the pass key?", **greedy})
        return answer.json()["answer"]
    finally:
        client.delete(f"/v1/sessions/{session}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--keys", nargs="+", default=["48213", "73906", "51287", "26415", "90372"])
    parser.add_argument("--book-chars", type=int, default=20_000, help="the first N characters of alice29.txt")
    args = parser.parse_args()
    book = BOOK.read_text(encoding="utf-8")[: args.book_chars]
    right = {False: 0, True: 0}
    print("| key | read-only session | remember |\n|---|---|---|")
    with httpx.Client(base_url=args.url, timeout=600) as client:
        for key in args.keys:
            answers = {remember: second_answer(client, book, key, remember) for remember in (False, True)}
            for remember, answer in answers.items():
                right[remember] += key in answer
            print(f"| {key} | {answers[False]!r} | {answers[True]!r} |")
    print(f"\nkey in the second answer: read-only {right[False]}/{len(args.keys)}, remember {right[True]}/{len(args.keys)}")


if __name__ == "__main__":
    main()
