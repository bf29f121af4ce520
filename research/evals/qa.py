"""The QA benchmark: questions about held-out books (research/evals/qa.jsonl), asked through the real
engine, per memory, beside an oracle row (the same model handed only the gold passage).

An answer is correct when it contains one of the question's accepted keywords as a word (a plural
"s" allowed), case aside. Gold recall@k: the share of questions where what the memory put in the
prompt overlaps the gold passage's characters.

    longdoc eval qa --memory oracle --memory text --memory truncate --write docs/studies/retrieval.md
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import statistics
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from engine.engine import Engine
from engine.interface import GenerationDone, GenerationEvent, GenerationParams, IngestDone, Retrieval, RetrievedItem, TokenDelta
from engine.memories import ContextPiece
from engine.prompts import with_context
from research.evals import texts
from research.training.evaluate import EvalSetup, markdown, run_with_engine

QUESTIONS = Path(__file__).with_name("qa.jsonl")
DEV_QUESTIONS = Path(__file__).with_name("qa_dev.jsonl")  # about texts.DEV_TEXTS: settings are chosen on these
ORACLE = "oracle"
ANSWER_TOKENS = 48


@dataclass(frozen=True)
class Question:
    id: str
    text: str
    question: str
    answers: tuple[str, ...]
    start: int
    end: int
    passage: str


def load_questions(path: Path = QUESTIONS, qa_dir: Path = texts.QA_DIR) -> list[Question]:
    """The questions, each checked against its text: the gold span must still hold the passage."""
    questions = []
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        question = Question(**{**row, "answers": tuple(row["answers"])})
        if texts.load(question.text, qa_dir)[question.start : question.end] != question.passage:
            raise ValueError(f"{question.id}: the gold span no longer holds its passage; was the text fetched differently?")
        questions.append(question)
    return questions


def is_correct(answer: str, keywords: Iterable[str]) -> bool:
    # a word: no letter or digit right before or after (an underscore, as in _Porcus_, may be)
    patterns = (r"\s+".join(re.escape(word) for word in k.split()) for k in keywords)  # any spacing between words
    return any(re.search(rf"(?<![^\W_]){p}(?:s|es)?(?![^\W_])", answer, re.IGNORECASE) for p in patterns)


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class Row:
    memory: str
    options: dict[str, Any]
    correct: int = 0
    asked: int = 0
    recalled: int | None = None  # questions whose prompt held the gold passage (retrieving memories)
    ingest_tokens: int = 0
    ingest_seconds: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    decode_rates: list[float] = field(default_factory=list)
    retrieval_seconds: list[float] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        low, high = wilson(self.correct, self.asked)
        return {
            "memory": self.memory + (f" {json.dumps(self.options)}" if self.options else ""),
            "accuracy": f"{self.correct}/{self.asked} = {self.correct / max(1, self.asked):.2f} [{low:.2f}, {high:.2f}]",
            "gold recall": "-"
            if self.recalled is None
            else f"{self.recalled}/{self.asked} = {self.recalled / max(1, self.asked):.2f}",
            "ingest tok/s": f"{self.ingest_tokens / self.ingest_seconds:,.0f}" if self.ingest_seconds else "-",
            "TTFT median (s)": f"{statistics.median(self.ttfts):.2f}" if self.ttfts else "-",
            "decode tok/s median": f"{statistics.median(self.decode_rates):.1f}" if self.decode_rates else "-",
            "retrieval ms median": f"{1000 * statistics.median(self.retrieval_seconds):.0f}" if self.retrieval_seconds else "-",
        }


# kvcache: the segments most layers selected that recall looks at: k·u under the defaults until
# 2026-11-26, kept so figures compare; with today's (the text index picks 12) every one attended counts
RECALL_SEGMENTS = 24
RECALLING = ("text", "kvcache")  # memories whose retrieval event names passages


def overlaps(items: Iterable[RetrievedItem], start: int, end: int) -> bool:
    """Whether the gold span meets a retrieved passage; for kvcache, one of the RECALL_SEGMENTS
    segments selected in the most layers (each layer and head selects its own)."""
    items = list(items)
    if items and items[0].layers is not None:
        items = sorted(items, key=lambda item: -(item.layers or 0))[:RECALL_SEGMENTS]
    return any(item.char_start < end and start < item.char_end for item in items)


async def score(
    row: Row, events: AsyncIterator[GenerationEvent], gold: tuple[int, int], answers: Iterable[str], label: str
) -> None:
    """Read one answer's events into `row`: recall of the gold span, timings, and whether it is right."""
    parts: list[str] = []
    async for event in events:
        if isinstance(event, Retrieval) and row.recalled is not None:
            row.recalled += overlaps(event.items, *gold)
            row.retrieval_seconds.append(event.seconds)
        elif isinstance(event, TokenDelta):
            parts.append(event.text)
        elif isinstance(event, GenerationDone):
            row.ttfts.append(event.ttft_seconds)
            if event.completion_tokens > 1 and event.total_seconds > event.ttft_seconds:
                row.decode_rates.append((event.completion_tokens - 1) / (event.total_seconds - event.ttft_seconds))
    answer = "".join(parts)
    row.asked += 1
    if is_correct(answer, answers):
        row.correct += 1
    else:
        row.missed.append(f"{label}: {' '.join(answer.split())[:80]!r}")


async def _ask(engine: Engine, row: Row, question: Question, session_id: str | None, oracle: bool) -> None:
    params = GenerationParams(max_tokens=ANSWER_TOKENS)
    if oracle:
        item = RetrievedItem(chunk_id=0, document_id=question.text, char_start=question.start, char_end=question.end, score=1.0)
        content = with_context(question.question, [ContextPiece(question.passage, item)])
        events = await engine.chat([{"role": "user", "content": content}], params, None, None)
    else:
        events = await engine.ask(session_id, question.question, params)  # type: ignore[arg-type]
    await score(row, events, (question.start, question.end), question.answers, question.id)


@contextlib.asynccontextmanager
async def ingested(engine: Engine, row: Row, memory: str, options: dict[str, Any], text: str, name: str) -> AsyncIterator[str]:
    """A new session holding `text`, its ingestion timed into `row`; deleted afterwards. The row
    names the options the session was made with: the model manifest's under the run's own."""
    session = engine.create_session(None, memory, options)
    row.options = dict(session.options)
    try:
        started = time.perf_counter()
        async for event in await engine.ingest(session.id, text, name):
            if isinstance(event, IngestDone):
                row.ingest_tokens += event.document.tokens
        row.ingest_seconds += time.perf_counter() - started
        yield session.id
    finally:
        engine.delete_session(session.id)


async def run_memory(engine: Engine, memory: str, options: dict[str, Any], questions: list[Question], qa_dir: Path) -> Row:
    row = Row(memory, options, recalled=0 if memory in RECALLING else None)
    by_text: dict[str, list[Question]] = {}
    for question in questions:
        by_text.setdefault(question.text, []).append(question)
    for name, asked in by_text.items():
        if memory == ORACLE:
            for question in asked:
                await _ask(engine, row, question, None, oracle=True)
            continue
        async with ingested(engine, row, memory, options, texts.load(name, qa_dir), name) as session_id:
            for question in asked:
                await _ask(engine, row, question, session_id, oracle=False)
        print(f"  {memory} {name}: {row.correct}/{row.asked} correct so far", flush=True)
    return row


def bench(
    setup: EvalSetup,
    runs: list[tuple[str, dict[str, Any]]],
    *,
    limit: int | None = None,
    qa_dir: Path = texts.QA_DIR,
    questions_path: Path = QUESTIONS,
) -> list[Row]:
    """One row per (memory, options); `limit` asks only the first questions of each text."""
    questions = load_questions(questions_path, qa_dir)
    if limit:
        ranks = [sum(p.text == q.text for p in questions[:i]) for i, q in enumerate(questions)]
        questions = [q for q, rank in zip(questions, ranks, strict=True) if rank < limit]

    async def body(engine: Engine) -> list[Row]:
        return [await run_memory(engine, memory, options, questions, qa_dir) for memory, options in runs]

    return run_with_engine(setup, 200_000, body)


class Summarized(Protocol):
    def summary(self) -> dict[str, Any]: ...


def table(rows: Sequence[Summarized]) -> str:
    return markdown([row.summary() for row in rows])


def section(rows: list[Row], command: str) -> str:
    import os

    import torch

    machine = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{os.cpu_count()} CPU cores, no GPU"
    names = ", ".join(f"{t.name} ({t.genre})" for t in texts.TEXTS)
    return (
        f"## QA benchmark ({machine})\n\n"
        f"{rows[0].asked} questions about {len(texts.TEXTS)} held-out texts: {names}; "
        "research/evals/qa.jsonl, texts by research/evals/texts.py. Greedy answers of at most "
        f"{ANSWER_TOKENS} tokens; correct when an accepted keyword appears as a word. Accuracy with its 95% "
        "Wilson interval; gold recall: the share of questions whose prompt held (part of) the gold passage. "
        "The oracle row hands the model the gold passage alone: the ceiling retrieval can reach with it. Command:\n\n"
        f"```\n{command}\n```\n\n{table(rows)}\n"
    )
