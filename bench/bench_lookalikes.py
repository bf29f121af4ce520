"""Look-alikes told apart by the words beside their names (`closest`, engine/memories/text/gather.py):
the generated records' look-alike questions, gathered with `closest` and with one that keeps every
sentence holding all the question's names (the gathering before it).

    .venv/bin/python -m bench.bench_lookalikes [--seeds 40] [--phrasing reworded] [--held-out]
    .venv/bin/python -m bench.bench_lookalikes --unchanged
    .venv/bin/python -m bench.bench_lookalikes --answers [--seeds 40] [--phrasing reworded]

By default, retrieval only (seconds): of each look-alike question, whether the gathering hands
over the one right sentence alone. `--unchanged`: whether `closest` changes what any QA or
hand-written whole-book question (development and held out) gathers. `--answers`: the default
model's answers to the look-alike questions alone, both ways, beside the oracle's (the fact
sentence alone) from the same run (4-5 minutes a way on 2 cores).
Development seeds 1..N and filler unless `--held-out` (seeds 101..100+N, held-out filler).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from engine.config import DEFAULT_MODEL
from engine.memories.text import gather
from engine.memories.text.options import TextOptions
from research.evals import texts, wholedoc
from research.training.evaluate import EvalSetup

QUESTION_FILES = ("qa.jsonl", "qa_dev.jsonl", "wholebook.jsonl", "wholebook_dev.jsonl")
BUDGETS = (TextOptions.gather_tokens, TextOptions.lookup_tokens)  # the text memory's own defaults


@contextmanager
def closest_as(chosen: Callable[..., list[gather.Sentence]]) -> Iterator[None]:
    """`gather` with `chosen` in place of `closest` while inside."""
    shipped = gather.closest
    gather.closest = chosen
    try:
        yield
    finally:
        gather.closest = shipped


def keep_every(documents: list[str], best: list[gather.Sentence], *_: object) -> list[gather.Sentence]:
    return best


WAYS = (("closest", gather.closest), ("every sentence", keep_every))


def look_alikes(seeds: int, phrasing: str, held_out: bool, length: int) -> list[wholedoc.Document]:
    first, filler = (101, wholedoc.HELD_OUT_FILLER) if held_out else (1, wholedoc.DEV_FILLER)
    docs = wholedoc.documents(tuple(range(first, first + seeds)), (length,), filler, phrasing=phrasing)
    return [replace(d, questions=tuple(q for q in d.questions if q.kind == "lookalike")) for d in docs]


def one_right_sentence(docs: list[wholedoc.Document]) -> int:
    """Questions whose gathering is their fact's sentence alone."""
    right = 0
    for doc in docs:
        for question in doc.questions:
            _, sentences = gather.gather([doc.text], question.question, *BUDGETS)
            ((a, b),) = question.facts
            right += len(sentences) == 1 and sentences[0].start <= a and b <= sentences[0].end
    return right


def question_rows(names: tuple[str, ...] = QUESTION_FILES) -> Iterator[tuple[str, dict, str]]:
    """(file name, row, its text) of each question of the QA and whole-book files `names`."""
    for name in names:
        for line in (Path(wholedoc.__file__).parent / name).read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            yield name, row, texts.load(row["text"])


def changed_gatherings() -> tuple[int, int]:
    """(questions whose gathering `closest` changes, questions) over the QA and whole-book files."""
    changed = total = 0
    for _, row, text in question_rows():
        found = []
        for _, way in WAYS:
            with closest_as(way):
                found.append(gather.gather([text], row["question"], *BUDGETS))
        changed += found[0] != found[1]
        total += 1
    return changed, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--phrasing", default="reworded", choices=("shipped", "reworded", "unseen"))
    parser.add_argument("--held-out", action="store_true")
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--unchanged", action="store_true")
    parser.add_argument("--answers", action="store_true")
    args = parser.parse_args()
    if args.phrasing == "unseen" and not args.held_out:
        parser.error("the unseen words are for held-out seeds only (--held-out)")
    if args.unchanged:
        changed, total = changed_gatherings()
        print(f"QA and whole-book questions whose gathering closest changes: {changed} of {total}")
        return
    docs = look_alikes(args.seeds, args.phrasing, args.held_out, args.length)
    asked = sum(len(d.questions) for d in docs)
    setup = EvalSetup(model=DEFAULT_MODEL, device="cpu")
    if args.answers:  # the reader handed each question's fact sentence alone, in the same run
        (row,) = wholedoc.bench(setup, [(wholedoc.ORACLE, {})], docs)
        print(f"oracle: answers {row.summary()['accuracy']}", *row.missed, sep="\n  ", flush=True)
    for label, way in WAYS:
        with closest_as(way):
            if args.answers:
                (row,) = wholedoc.bench(setup, [("text", {})], docs)
                print(f"{label}: answers {row.summary()['accuracy']}", *row.missed, sep="\n  ", flush=True)
            else:
                print(f"{label}: the one right sentence alone for {one_right_sentence(docs)} of {asked}", flush=True)


if __name__ == "__main__":
    main()
