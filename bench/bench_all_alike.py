"""A few sentences all alike read as every mention when the question's form is clearly a
whole-document one (`STRICT_MARGIN`, engine/memories/text/question_form.py): which questions the
rule reaches, their forms' margins, and (`--answers`) their answers three ways.

    .venv/bin/python -m bench.bench_all_alike [--seeds 12]
    .venv/bin/python -m bench.bench_all_alike --answers [--seeds 12]

A question is reached when two to four sentences name its names, all alike, so a lookup would hand
over every one of them (within its budget, with one hop) beside ranked chunks (gather.py), and
every mention fits: a form read clearly whole changes its gathering. (Its prompt may still not
change: a ranked chunk that stands out makes a whole gathering a ranked answer, memory.py.)
Budgets: the default model's manifest's. By default (seconds): each reached
question of the QA and hand-written whole-book files (development and held out) and of the
development records (seeds 1..N, 32K and 128K, shipped and reworded words), with its margin.
`--answers`: the reached development questions answered by the default model with the strict
margin never passed (the lookup, as before), at STRICT_MARGIN (shipped), and at FORM_MARGIN (the
plain margin), a session a document (minutes on 2 cores).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

from bench.bench_lookalikes import question_rows
from engine.config import DEFAULT_MODEL, SHIPPED_EMBEDDER_ADAPTER
from engine.engine import Engine
from engine.interface import GenerationParams, TokenDelta
from engine.memories.text import question_form
from engine.memories.text.gather import common_words, gather, question_names
from engine.memories.text.options import TextOptions
from engine.models.embedder import Embedder
from engine.models.manifest import manifest_of, memory_options
from research.evals import qa, wholedoc
from research.training.evaluate import EvalSetup, run_with_engine

DEVELOPMENT_FILES = ("qa_dev.jsonl", "wholebook_dev.jsonl")
SHIPPED = TextOptions(**memory_options(manifest_of(DEFAULT_MODEL, "")).get("text", {}))
BUDGETS = (SHIPPED.gather_tokens, min(SHIPPED.gather_tokens, SHIPPED.lookup_tokens))  # as the memory passes them
MARGINS = (
    ("lookup (before)", float("inf")),
    ("strict (shipped)", question_form.STRICT_MARGIN),
    ("plain", question_form.FORM_MARGIN),
)
ANSWER_TOKENS = 64


@dataclass(frozen=True)
class Reached:
    source: str  # the question file, or the records' words and length
    id: str
    question: str
    document: str
    text: str
    answers: tuple[str, ...]
    record: wholedoc.Question | None  # a record's question (graded by its kind), None for a file's


def reaches(text: str, question: str) -> bool:
    """Whether the strict branch decides this question: a form read clearly whole changes its gathering."""
    strict_only = gather([text], question, *BUDGETS, recurring=lambda asked, names, strict: strict)
    never = gather([text], question, *BUDGETS, recurring=lambda asked, names, strict: False)
    return strict_only != never


def reached(seeds: int, development_only: bool) -> Iterator[Reached]:
    files = DEVELOPMENT_FILES + (() if development_only else ("qa.jsonl", "wholebook.jsonl"))
    for name, row, text in question_rows(files):
        if reaches(text, row["question"]):
            yield Reached(name, row["id"], row["question"], row["text"], text, tuple(row["answers"]), None)
    for phrasing in ("shipped", "reworded"):
        docs = wholedoc.documents(tuple(range(1, seeds + 1)), (32768, 131072), wholedoc.DEV_FILLER, phrasing=phrasing)
        for doc in docs:
            for q in doc.questions:
                if reaches(doc.text, q.question):
                    yield Reached(f"records, {phrasing}", q.id, q.question, doc.name, doc.text, q.answers, q)


def right(item: Reached, answer: str) -> bool:
    return wholedoc.grade(item.record, answer) if item.record is not None else qa.is_correct(answer, item.answers)


def answers(items: list[Reached]) -> None:
    async def body(engine: Engine) -> None:
        score = {name: 0 for name, _ in MARGINS}
        for document in dict.fromkeys(item.document for item in items):
            mine = [item for item in items if item.document == document]
            session = engine.create_session(None, "text", {})
            try:
                async for _ in await engine.ingest(session.id, mine[0].text, document):
                    pass
                for item in mine:
                    marks = []
                    for name, value in MARGINS:
                        with mock.patch.object(question_form, "STRICT_MARGIN", value):
                            events = await engine.ask(session.id, item.question, GenerationParams(max_tokens=ANSWER_TOKENS))
                            answer = " ".join("".join([e.text async for e in events if isinstance(e, TokenDelta)]).split())
                        correct = right(item, answer)
                        score[name] += correct
                        marks.append(f"{name} {'right' if correct else 'wrong'}")
                    print(f"{item.source} {item.id}: {', '.join(marks)}", flush=True)
            finally:
                engine.delete_session(session.id)
        print(", ".join(f"{name} {count}/{len(items)}" for name, count in score.items()))

    run_with_engine(EvalSetup(model=DEFAULT_MODEL, device="cpu"), 200_000, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=12, help="development records' seeds 1..N")
    parser.add_argument("--answers", action="store_true", help="answer the reached development questions three ways")
    args = parser.parse_args()
    items = list(reached(args.seeds, args.answers))
    if args.answers:
        answers(items)
        return
    form = question_form.QuestionForm(Embedder(adapter=SHIPPED_EMBEDDER_ADAPTER))
    for item in items:
        names = question_names(item.question, common_words([item.text]))
        print(f"{form.margin(item.question, names):+.3f} {item.source} {item.id}: {item.question}")
    print(f"{len(items)} questions reached; strict margin {question_form.STRICT_MARGIN}, plain {question_form.FORM_MARGIN}")


if __name__ == "__main__":
    main()
