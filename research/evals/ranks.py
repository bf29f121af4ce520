"""Where the gold passage ranks in `text` retrieval, no answer generated: recall@k for k in RECALL_AT.

A question's rank is the place of the first chunk that meets its gold span, in the order the
memory takes chunks (`TextMemory.ranked_spans`: fused scores, or the reader's order with `rerank`);
recall@k is the share of questions ranked within the first k. It tells retrieval settings apart in
seconds where the QA and needle benchmarks take minutes, and it says which k a prompt would need;
with margins, how many excerpts each would leave and how often the gold chunk is among them.

    longdoc eval ranks --dev --memory text --memory 'text {"fusion": "rank"}'
    longdoc eval ranks --needles 32768 --seeds 6 --memory text
    longdoc eval ranks --dev --memory 'text {"margin": 0}' --margin 1.5 --margin 2.0
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.engine import Engine
from engine.memories.text.memory import TextMemory
from engine.memories.text.options import TextOptions
from research.evals import needles, texts
from research.evals.qa import Row, ingested, load_questions
from research.training.evaluate import EvalSetup, run_with_engine

RECALL_AT = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Gold:
    question: str
    start: int
    end: int


@dataclass
class RankRow:
    label: str
    options: dict[str, Any]
    ranks: list[int | None] = field(default_factory=list)  # None: not among the ranked chunks
    gaps: list[list[float]] = field(default_factory=list)  # per question: the first chunks' scores below the first's
    seconds: list[float] = field(default_factory=list)  # ranking one question

    def summary(self) -> dict[str, Any]:
        asked = len(self.ranks)
        row = {"memory": self.label + (f" {json.dumps(self.options)}" if self.options else ""), "questions": asked}
        for k in RECALL_AT:
            row[f"recall@{k}"] = f"{sum(r is not None and r < k for r in self.ranks) / max(1, asked):.2f}"
        row["ranking ms median"] = f"{1000 * statistics.median(self.seconds):.0f}" if self.seconds else "-"
        return row

    def with_margin(self, margin: float) -> dict[str, Any]:
        """What `text`'s `margin` would take of each question's first `top_k` chunks (the token
        budget aside, and touching chunks counted apart): chunks a question, and questions whose
        gold chunk is among them. Where the margin is inert (`TextOptions.score_margin`), all `top_k`."""
        options = TextOptions(**{**self.options, "margin": margin})
        top_k, applied = options.top_k, options.score_margin() or math.inf
        kept = [sum(gap <= applied for gap in gaps[:top_k]) for gaps in self.gaps]
        golds = sum(rank is not None and rank < n for rank, n in zip(self.ranks, kept, strict=True))
        return {
            "memory": self.label + (f" {json.dumps(self.options)}" if self.options else ""),
            "margin": f"{margin:g}",
            "chunks a question (mean)": f"{statistics.mean(kept):.2f}" if kept else "-",
            "gold among them": f"{golds}/{len(kept)}",
        }


def gold_rank(spans: Iterable[tuple[int, int]], start: int, end: int) -> int | None:
    """The place (0 first) of the first span that meets [start, end), or None."""
    return next((place for place, (a, b) in enumerate(spans) if a < end and start < b), None)


async def _rank(engine: Engine, row: RankRow, options: dict[str, Any], text: str, golds: list[Gold]) -> None:
    ingesting = Row("text", options)
    async with ingested(engine, ingesting, "text", options, text, "document") as session_id:
        row.options = ingesting.options  # as the session was made: the manifest's under the run's
        session = engine.sessions.peek(session_id)
        assert session is not None and isinstance(session.memory, TextMemory)
        for gold in golds:
            started = time.perf_counter()  # on the memory's worker, where the server retrieves
            spans = await engine.session_service.memory_worker(session).run(session.memory.ranked_spans, gold.question)
            row.seconds.append(time.perf_counter() - started)
            row.ranks.append(gold_rank(((a, b) for _, a, b, _ in spans), gold.start, gold.end))
            first = spans[: max(RECALL_AT[-1], session.memory.options.top_k)]
            row.gaps.append([spans[0][3] - score for *_, score in first])


def qa_documents(questions_path: Path, qa_dir: Path = texts.QA_DIR) -> list[tuple[str, list[Gold]]]:
    """Per text of a question set, its text and its questions' gold spans."""
    by_text: dict[str, list[Gold]] = {}
    for q in load_questions(questions_path, qa_dir):
        by_text.setdefault(q.text, []).append(Gold(q.question, q.start, q.end))
    return [(texts.load(name, qa_dir), golds) for name, golds in by_text.items()]


def needle_documents(engine: Engine, length: int, seeds: int, qa_dir: Path = texts.QA_DIR) -> list[tuple[str, list[Gold]]]:
    """The needle benchmark's documents of `length` tokens, with each needle's span."""
    documents = []
    for seed in range(seeds):
        text, placed = needles.document(length, engine.tokenizer(), seed, qa_dir)
        golds = [Gold(n.question, text.index(n.fact), text.index(n.fact) + len(n.fact)) for n in placed]
        documents.append((text, golds))
    return documents


def bench(
    setup: EvalSetup,
    runs: list[dict[str, Any]],
    *,
    questions_path: Path | None,
    length: int = 0,
    seeds: int = 0,
    qa_dir: Path = texts.QA_DIR,
) -> list[RankRow]:
    """One row per `text` options: over the question set's texts, or (no questions) the needles."""

    async def body(engine: Engine) -> list[RankRow]:
        if questions_path is not None:
            documents, label = qa_documents(questions_path, qa_dir), "text"
        else:
            documents, label = needle_documents(engine, length, seeds, qa_dir), f"text @{length // 1024}K"
        rows = []
        for options in runs:
            row = RankRow(label, options)
            for text, golds in documents:
                await _rank(engine, row, options, text, golds)
            rows.append(row)
        return rows

    return run_with_engine(setup, 200_000, body)
