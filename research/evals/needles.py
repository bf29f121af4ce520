"""Fact needles in prose: invented facts of six kinds, each said in one of several phrasings, put at
chosen depths of held-out filler (the Jargon File, letters D-Z: no training run and no QA question
reads it), then asked about through the real engine.

A document holds one needle of each kind, at depths spread over it; the facts are invented, so no
model knows them beforehand.

    longdoc eval needles --memory text --length 8192 --length 131072
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.engine import Engine
from engine.interface import GenerationParams
from research.evals import texts
from research.evals.qa import ANSWER_TOKENS, RECALLING, Row, ingested, score
from research.training.evaluate import EvalSetup, run_with_engine

FILLER = texts.QaText("jargon-d-z", "filler", texts.BY_NAME["jargon"].source, start="   :daemon:")

FIRST = ("Orsolya", "Teodor", "Mirela", "Casimir", "Ysolde", "Bartholomew", "Philippa", "Anselm", "Rosalind", "Evander")
LAST = (
    "Brightwater",
    "Quennell",
    "Marchetti",
    "Oakhollow",
    "Szabados",
    "Vennard",
    "Ilvermoor",
    "Castellane",
    "Dunmore",
    "Feathergill",
)
PLACES = (
    "Port Velmira",
    "Aldenreach",
    "Saint Ombrel",
    "Kestrelmouth",
    "Vintry Cross",
    "Lake Oravessa",
    "Harrowgate Fen",
    "Duskwater",
)
TITLES = (
    "The Glass Orchard",
    "A Ledger of Tides",
    "Songs for the Lamplighter",
    "The Copper Almanac",
    "Winter at Greyfold",
    "The Ninth Lantern",
)
MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)
SUBJECTS = (
    "the old observatory",
    "the harbour tunnel",
    "the river museum",
    "the northern archive",
    "the glassworks",
    "the signal tower",
)

# kind -> (fact phrasings, question), "{s}" the subject and "{v}" the value
KINDS: dict[str, tuple[tuple[str, ...], str]] = {
    "name": (
        (
            "The keeper of {s} was a woman named {v}.",
            "Few remember that {s} was looked after by {v} for many years.",
            "It was {v} who kept the keys of {s}.",
        ),
        "Who kept {s}? Give the name.",
    ),
    "number": (
        (
            "Exactly {v} visitors passed through {s} in its first year.",
            "In its first year {s} counted {v} visitors.",
            "The ledger of {s} records {v} visitors in the first year.",
        ),
        "How many visitors did {s} have in its first year?",
    ),
    "place": (
        (
            "The bell of {s} was cast in a foundry at {v}.",
            "{v} is where the foundry that cast the bell of {s} stood.",
            "They cast the bell of {s} at {v}, far to the south.",
        ),
        "Where was the bell of {s} cast?",
    ),
    "code": (
        (
            "The door of {s} opens with the code {v}.",
            "To open the door of {s}, one types {v}.",
            "The code that opens the door of {s} is {v}.",
        ),
        "What code opens the door of {s}?",
    ),
    "date": (
        ("{s} first opened on {v}.", "On {v}, {s} opened for the first time.", "The first day {s} was open was {v}."),
        "On what date did {s} first open?",
    ),
    "title": (
        (
            "The only book kept in {s} was called {v}.",
            "A single book lay in {s}: {v}.",
            "{v} was the one book anyone ever found in {s}.",
        ),
        "What was the title of the book kept in {s}?",
    ),
}


@dataclass(frozen=True)
class Needle:
    kind: str
    fact: str
    question: str
    answers: tuple[str, ...]
    depth: float


def draw(kind: str, subject: str, rng: random.Random) -> tuple[str, str, tuple[str, ...]]:
    """(fact sentence, question, accepted answers) of one invented fact."""
    value = {
        "name": lambda: f"{rng.choice(FIRST)} {rng.choice(LAST)}",
        "number": lambda: f"{rng.randrange(1_000, 99_999):,}",
        "place": lambda: rng.choice(PLACES),
        "code": lambda: f"{rng.choice('QXZKVJ')}{rng.choice('QXZKVJ')}-{rng.randrange(1000, 9999)}",
        "date": lambda: f"{rng.randrange(1, 29)} {rng.choice(MONTHS)} {rng.randrange(1820, 1990)}",
        "title": lambda: rng.choice(TITLES),
    }[kind]()
    phrasings, question = KINDS[kind]
    fact = rng.choice(phrasings).format(s=subject, v=value)
    answers = [value, value.replace(",", "")]
    if kind == "date":  # "14 March 1987" also as "March 14, 1987"
        day, month, year = value.split()
        answers.append(f"{month} {day}, {year}")
    elif kind == "name":  # the surname alone names the person
        answers.append(value.split()[-1])
    elif kind == "title":  # without its article
        answers.append(value.split(" ", 1)[1] if value.startswith(("The ", "A ")) else value)
    return fact[0].upper() + fact[1:], question.format(s=subject), tuple(dict.fromkeys(answers))


def document(length_tokens: int, tokenizer: Any, seed: int, qa_dir: Path = texts.QA_DIR) -> tuple[str, list[Needle]]:
    """Filler of about `length_tokens` tokens with one needle of each kind at spread depths."""
    rng = random.Random(seed)
    filler = texts.load_spec(FILLER, qa_dir)
    ids = tokenizer(filler[: length_tokens * 8], add_special_tokens=False)["input_ids"][:length_tokens]
    body = tokenizer.decode(ids)
    kinds, subjects = list(KINDS), rng.sample(SUBJECTS, len(KINDS))
    depths = [(i + rng.uniform(0.1, 0.9)) / len(kinds) for i in range(len(kinds))]  # one in each sixth of the text
    rng.shuffle(kinds)
    needles, pieces, last = [], [], 0
    for kind, subject, depth in zip(kinds, subjects, depths, strict=True):
        cut = body.find("\n\n", int(depth * len(body)))  # between paragraphs
        cut = len(body) if cut < 0 else cut
        fact, question, answers = draw(kind, subject, rng)
        pieces += [body[last:cut], "\n\n   " + fact]
        needles.append(Needle(kind, fact, question, answers, depth))
        last = cut
    pieces.append(body[last:])
    return "".join(pieces), needles


async def _run(engine: Engine, memory: str, options: dict[str, Any], length: int, seeds: range, qa_dir: Path) -> Row:
    row = Row(f"{memory} @{length // 1024}K", options, recalled=0 if memory in RECALLING else None)
    for seed in seeds:
        text, needles = document(length, engine.tokenizer(), seed, qa_dir)
        async with ingested(engine, row, memory, options, text, "needles") as session_id:
            for needle in needles:
                await _ask(engine, row, session_id, needle, text)
    return row


async def _ask(engine: Engine, row: Row, session_id: str, needle: Needle, text: str) -> None:
    start = text.index(needle.fact)
    events = await engine.ask(session_id, needle.question, GenerationParams(max_tokens=ANSWER_TOKENS))
    await score(
        row, events, (start, start + len(needle.fact)), needle.answers, f"{needle.kind}@{needle.depth:.2f} {needle.answers[0]!r}"
    )


def bench(
    setup: EvalSetup, runs: list[tuple[str, dict[str, Any]]], lengths: list[int], seeds: int = 3, qa_dir: Path = texts.QA_DIR
) -> list[Row]:
    async def body(engine: Engine) -> list[Row]:
        return [await _run(engine, m, o, n, range(seeds), qa_dir) for m, o in runs for n in lengths]

    return run_with_engine(setup, max(lengths) * 2, body)
