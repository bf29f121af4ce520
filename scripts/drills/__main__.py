"""`make drills`: reliability drills against a real `longdoc serve` on the small model (SmolLM2-135M; scripts/drills/server.py).

    python -m scripts.drills [--only sweep,refusals,load,rss,crash,fuzz,first,capacity,summary,second] [--sessions 16] [--starts 10] [--out results.json]

`capacity`, `summary` and `second` run the default model (not the small one) on default settings,
and are not in the default run: `make drill-capacity`, `make drill-summary`, `make drill-second`.

Prints each drill's figures as JSON and exits non-zero if any drill failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from engine.config import DEFAULT_MODEL
from research.training.corpus import fetch
from scripts.drills.capacity import capacity_passed, run_capacity
from scripts.drills.crash import crash_passed, run_crash
from scripts.drills.first import first_passed, run_first
from scripts.drills.fuzz import fuzz_passed, run_fuzz
from scripts.drills.load import BOOK, load_passed, run_load
from scripts.drills.refusals import refusals_passed, run_refusals
from scripts.drills.rss import rss_passed, run_rss
from scripts.drills.second import run_second, second_passed
from scripts.drills.server import Server
from scripts.drills.summary import run_summary, summary_passed
from scripts.drills.sweep import run_sweep, sweep_passed

DRILLS = ("sweep", "refusals", "load", "rss", "crash", "fuzz", "first")
EXTRA_DRILLS = ("capacity", "summary", "second")  # asked for by name only
LEAK_TOLERANCE = 0.05
MAX_DOCUMENT_BYTES = 2_000_000
# Bounded so a drill measures the server's handling, not minutes of decoding on 2 cores.
SERVER_ARGS = [
    "--max-new-tokens",
    "32",
    "--default-max-tokens",
    "16",
    "--max-document-bytes",
    str(MAX_DOCUMENT_BYTES),
    "--max-prompt-chars",
    "100000",
    "--max-sessions",
    "256",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(DRILLS), help="comma-separated: " + ", ".join(DRILLS))
    parser.add_argument("--sessions", type=int, default=16, help="concurrent sessions in the load drill")
    parser.add_argument("--rounds", type=int, default=3, help="load rounds on one server (a leak grows every round)")
    parser.add_argument("--keys", type=int, default=4, help="API keys the load drill's sessions are spread over")
    parser.add_argument("--fuzz-examples", type=int, default=20)
    parser.add_argument("--fuzz-seconds", type=int, default=900)
    parser.add_argument("--starts", type=int, default=10, help="server starts in the first-answer drill")
    parser.add_argument("--people", type=int, default=32, help="questions asked at once in the capacity drill")
    parser.add_argument("--streams", type=int, default=8, help="streams whose aggregate decode the capacity drill measures")
    parser.add_argument("--capacity-tokens", type=int, default=128, help="new tokens of each capacity drill answer")
    parser.add_argument("--stream-rounds", type=int, default=3, help="rounds of one stream, then many, in the capacity drill")
    parser.add_argument("--summary-book", type=Path, default=BOOK, help="the book the summary drill summarizes")
    parser.add_argument("--pairs", type=int, default=3, help="question pairs per text in the second-question drill")
    parser.add_argument("--dev", action="store_true", help="the second-question drill on the development texts")
    parser.add_argument("--out", type=Path, help="also write the results here as JSON")
    args = parser.parse_args()
    chosen = [d for d in args.only.split(",") if d]
    unknown = set(chosen) - set(DRILLS) - set(EXTRA_DRILLS)
    if unknown:
        parser.error(f"unknown drills {sorted(unknown)}")

    keys = [f"drill-key-{i}-{'x' * 8}" for i in range(args.keys)]
    with tempfile.TemporaryDirectory() as folder:
        keys_file = Path(folder) / "keys"
        keys_file.write_text("".join(f"user{i}:{key}\n" for i, key in enumerate(keys)))
        results, passed = {}, {}
        book = BOOK.read_text(encoding="utf-8")
        if "refusals" in chosen:  # the server's default limits (32 MiB documents, 4 MiB JSON bodies)
            server = Server([]).start()
            try:
                results["refusals"] = run_refusals(server)
                passed["refusals"] = refusals_passed(results["refusals"])
                report("refusals", results["refusals"])
            finally:
                server.stop()
        if {"sweep", "rss", "fuzz"} & set(chosen):  # no keys: every route reachable without headers
            server = Server(SERVER_ARGS).start()
            try:
                if "sweep" in chosen:
                    results["sweep"] = run_sweep(server, MAX_DOCUMENT_BYTES, book[:20_000])
                    passed["sweep"] = sweep_passed(results["sweep"])
                    report("sweep", results["sweep"])
                if "rss" in chosen:
                    results["rss"] = run_rss(server, book, caches=4, capacity=1_000_000, documents=8)
                    passed["rss"] = rss_passed(results["rss"])
                    report("rss", results["rss"])
                if "fuzz" in chosen:
                    results["fuzz"] = run_fuzz(server, max_examples=args.fuzz_examples, max_time=args.fuzz_seconds)
                    passed["fuzz"] = fuzz_passed(results["fuzz"])
                    report("fuzz", results["fuzz"])
            finally:
                log = server.stop()
        if "load" in chosen:
            server = Server(SERVER_ARGS + ["--api-keys-file", str(keys_file)]).start()
            try:
                rounds = [asyncio.run(run_load(server, keys, args.sessions)) for _ in range(args.rounds)]
            finally:
                log = server.stop()
            results["load"] = {"rounds": rounds, "keys_in_log": any(key in log for key in keys)}
            # all sessions are deleted after each round: RSS that keeps growing round after round is a leak
            first, last = rounds[0]["rss_after_mib"], rounds[-1]["rss_after_mib"]
            results["load"]["rss_growth_after_first_round_mib"] = round(last - first, 1)
            passed["load"] = (
                all(load_passed(r) for r in rounds)
                and not results["load"]["keys_in_log"]
                and last <= first * (1 + LEAK_TOLERANCE)
            )
            report("load", results["load"])
    if "crash" in chosen:  # the small model and its default memory (its manifest's)
        results["crash"] = run_crash(SERVER_ARGS, book, memory=None)
        passed["crash"] = crash_passed(results["crash"])
        report("crash", results["crash"])
    if "capacity" in chosen:  # the default model, default settings
        server = Server([], env={"LONGDOC_MODEL": DEFAULT_MODEL}).start(timeout=1800)
        try:
            results["capacity"] = asyncio.run(
                run_capacity(server, book, args.people, args.streams, args.capacity_tokens, args.stream_rounds)
            )
        finally:
            server.stop()
        passed["capacity"] = capacity_passed(results["capacity"])
        report("capacity", results["capacity"])
    if "summary" in chosen:  # the default model, default settings
        server = Server([], env={"LONGDOC_MODEL": DEFAULT_MODEL}).start(timeout=1800)
        try:
            results["summary"] = asyncio.run(run_summary(server, args.summary_book.read_text(encoding="utf-8")))
        finally:
            server.stop()
        passed["summary"] = summary_passed(results["summary"])
        report("summary", results["summary"])
    if "second" in chosen:  # the default model, default settings
        results["second"] = run_second(DEFAULT_MODEL, args.dev, args.pairs, 32)
        passed["second"] = second_passed(results["second"])
        report(
            "second",
            {k: {m: n for m, n in v.items() if m != "rows"} if isinstance(v, dict) else v for k, v in results["second"].items()},
        )
    if "first" in chosen:
        results["first"] = run_first(SERVER_ARGS, (fetch() / "plrabn12.txt").read_text(encoding="utf-8"), args.starts)
        passed["first"] = first_passed(results["first"])
        report("first", results["first"])
    for name in chosen:
        print(f"{name}: {'PASS' if passed[name] else 'FAIL'}")
    if args.out:
        args.out.write_text(json.dumps({"results": results, "passed": passed}, indent=2, default=str))
    return 0 if all(passed.values()) else 1


def report(name: str, result: dict) -> None:
    shown = {k: v for k, v in result.items() if k not in ("rows", "tail")}
    print(f"== {name}\n{json.dumps(shown, indent=2, default=str)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
