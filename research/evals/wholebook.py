"""Hand-written whole-book questions about the QA benchmark's held-out texts
(research/evals/wholebook.jsonl): how a book ends, what happens in a named chapter, everyone at a
scene, counts, first/last, order, comparisons and two hops across distant passages. Each names
the exact passages that answer it (`evidence`, found in the text as the benchmark cuts it), which
the oracle row is handed in document order; graded by keywords (`rule`: "any" one of them, "all"
every one, and for an id holding "order" every one in the listed order).

    longdoc eval wholebook --memory oracle --memory text --memory truncate
    longdoc eval wholebook --dev ...    # the development questions (wholebook_dev.jsonl)
"""

from __future__ import annotations

import json
from pathlib import Path

from research.evals import texts
from research.evals.wholedoc import Document, Question

QUESTIONS = Path(__file__).with_name("wholebook.jsonl")
# development questions, on the QA benchmark's development texts (As You Like It, Genesis): settings
# are chosen on these, never on the held-out ones above
DEV_QUESTIONS = Path(__file__).with_name("wholebook_dev.jsonl")


def load(path: Path = QUESTIONS, qa_dir: Path = texts.QA_DIR) -> list[Document]:
    """One document per text, holding its questions; each evidence quote must stand in the text."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    by_text: dict[str, list[Question]] = {}
    loaded: dict[str, str] = {}
    for row in rows:
        text = loaded.setdefault(row["text"], texts.load(row["text"], qa_dir))
        spans = []
        for quote in row["evidence"]:
            start = text.find(quote)
            if start < 0:
                raise ValueError(f"{row['id']}: evidence not in {row['text']}: {quote[:60]!r}")
            spans.append((start, start + len(quote)))
        kind = "book_order" if "order" in row["id"] else f"book_{row['rule']}"
        question = Question(row["id"], kind, row["question"], tuple(row["answers"]), (), tuple(sorted(spans)))
        by_text.setdefault(row["text"], []).append(question)
    return [Document(name, loaded[name], tuple(questions)) for name, questions in by_text.items()]
