"""Whole-document questions: generated records whose answers are spread over a long document.

A document is filler prose from a public-domain book (research/training/corpus.py) with an invented
record woven through it: short fact paragraphs at random places. Each document carries one
question of each kind, its facts' character spans, and a grading rule:

- count: how many times one ship docked at one port (other ships and ports as distractors);
  correct when the answer's first number is the count;
- list: every town one envoy sailed to (another envoy's towns as distractors); correct when all
  are named and no distractor is;
- first_last: who was appointed first (or last) to an office; correct when the right name is the
  first of the candidates the answer names;
- compare: which of two ships came to a port more often; the same rule;
- two_hop: a person's mother's trade, the link and the trade at least a quarter of the document
  apart (another family as distractor); correct when the trade is named and the distractor's is not;
- order: the order in which a traveller met three figures, asked in another order; correct when
  all three are named, in the order met;
- lookalike (two questions): what one of many people sharing first names, surnames, trades and
  streets left to the parish; correct when the right bequest is named and no other of theirs is.

Each kind's facts stand in record order (counts, successions and meetings run forward) at random
places of their own, so the kinds interleave through the document.

Several phrasings per kind, chosen by the seed; seeds DEV_SEEDS for choosing settings, HELD_OUT_SEEDS
for the figures, and the filler of each from different books. Two more sets of phrasings
(`PHRASINGS`, written 2026-11-30 after the gathering rules, in words a reader might use and mostly
without the words those rules look for) ask the same records' questions otherwise, to see whether
the figures hold beyond the wordings the rules were built on: "reworded" to choose settings on,
with the development seeds, and "unseen" for held-out figures only.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.engine import Engine
from engine.interface import GenerationDone, GenerationParams, Retrieval, RetrievedItem, TokenDelta
from engine.memories import ContextPiece
from engine.prompts import with_context
from research.evals.qa import ORACLE, wilson
from research.training.corpus import DEFAULT_DIR, fetch
from research.training.evaluate import EvalSetup, run_with_engine

DEV_SEEDS = (1, 2, 3)
HELD_OUT_SEEDS = (101, 102, 103, 104)
DEV_FILLER = ("asyoulik.txt", "lcet10.txt", "kjv-Genesis.txt")
HELD_OUT_FILLER = ("alice29.txt", "plrabn12.txt", "kjv-Acts.txt")
CHARS_PER_TOKEN = 4.0  # filler: about 4 characters a token; documents are sized by characters
KINDS = ("count", "list", "first_last", "compare", "two_hop", "order", "lookalike")

_ONSETS = ("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "br", "dr", "gr", "st", "th", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ia", "ou")
_CODAS = ("", "n", "r", "l", "s", "th", "rn", "nd", "x", "m")
_NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
_TRADES = ("cooper", "glassblower", "tanner", "chandler", "wheelwright", "saddler", "weaver", "potter", "thatcher", "fletcher")
_STREETS = ("Mill Row", "Tanner Street", "Church Lane", "Market Hill", "Well Yard", "Bridge End")
_BEQUESTS = (
    "chalice",
    "lectern",
    "tapestry",
    "organ",
    "orchard",
    "bell",
    "psalter",
    "candlesticks",
    "font",
    "meadow",
    "clock",
    "granary",
)
_FIGURES = ("Archivist", "Ferryman", "Cartographer", "Lamplighter", "Beekeeper", "Falconer")
_CARGO = ("salt", "timber", "wool", "wine", "iron", "grain", "hides", "amber")

# The records' questions in other words (the module's docstring); each template takes the fields
# its kind records (`_Record.ask`).
PHRASINGS: dict[str, dict[str, tuple[str, ...]]] = {
    "reworded": {
        "count": (
            "What is the number of times the {ship} docked at {port}?",
            "Tally the occasions on which the {ship} put in at {port}.",
            "The {ship} docked at {port} more than once. On how many occasions?",
        ),
        "list": (
            "Which towns did the envoy {envoy} sail to?",
            "Where did {envoy} travel as envoy? Give the towns.",
            "What towns did the envoy {envoy} reach by sea?",
        ),
        "first": (
            "Who became harbourmaster of {port} before any other?",
            "Who held the office of harbourmaster of {port} earliest?",
        ),
        "last": ("Who was the most recent harbourmaster appointed at {port}?", "Who was made harbourmaster of {port} latest?"),
        "compare": (
            "Was the {a} or the {b} the more frequent visitor to {port}?",
            "Between the {a} and the {b}, which entered the harbour of {port} on more occasions?",
        ),
        "two_hop": ("What did {child}'s mother do for a living?", "{child}'s mother had a trade. What was it?"),
        "order": (
            "{traveller} met the {a}, the {b} and the {c}. Which of them came first, second and third?",
            "Arrange the {a}, the {b} and the {c} by when {traveller} met them.",
        ),
        "lookalike": (
            "What bequest to the parish came from {first} {initial}. {surname}, the {trade} of {street}?",
            "{first} {initial}. {surname} ({trade}, {street}) left something to the parish. What?",
        ),
    },
    "unseen": {
        "count": (
            "Over the whole record, how frequently did the {ship} come to dock at {port}? State a number.",
            "Give me the number of the {ship}'s dockings at {port}.",
        ),
        "list": (
            "Tell me the towns the envoy {envoy} visited.",
            "The envoy {envoy} made several voyages. To what towns?",
            "Give the complete set of towns {envoy} reached as envoy.",
        ),
        "first": ("Who was {port}'s original harbourmaster?", "Name the initial holder of the post of harbourmaster of {port}."),
        "last": (
            "Who was named harbourmaster of {port} after all the others?",
            "Name the final holder of the post of harbourmaster of {port}.",
        ),
        "compare": (
            "Which of the two ships, the {a} or the {b}, called at {port} the greater number of times?",
            "Did {port} see the {a} more, or the {b}?",
        ),
        "two_hop": ("By what trade did the mother of {child} earn her bread?", "Which occupation did {child}'s mother follow?"),
        "order": (
            "Give the sequence in which {traveller} encountered the {a}, the {b} and the {c}.",
            "Of the {a}, the {b} and the {c}, whom did {traveller} meet first, whom next, and whom last?",
        ),
        "lookalike": (
            "Tell me what the {trade} {first} {initial}. {surname} of {street} gave the parish.",
            "What was left to the parish by {first} {initial}. {surname}, {trade}, of {street}?",
        ),
    },
}


@dataclass(frozen=True)
class Question:
    id: str
    kind: str
    question: str
    answers: tuple[str, ...]  # what a correct answer names (the rule: `grade`)
    candidates: tuple[str, ...]  # first_last, compare: the names an answer may choose among
    facts: tuple[tuple[int, int], ...]  # the fact paragraphs' character spans, in document order
    distractors: tuple[str, ...] = ()  # list, two_hop, lookalike: names a correct answer does not give


@dataclass(frozen=True)
class Document:
    name: str
    text: str
    questions: tuple[Question, ...]


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)).capitalize()


class _Names:
    """Invented names, each new and none a word of the filler."""

    def __init__(self, rng: random.Random, filler: str) -> None:
        self.rng, self.used = rng, set(re.findall(r"[a-z]+", filler.lower()))

    def __call__(self, syllables: int = 2) -> str:
        while True:
            name = _word(self.rng, syllables)
            if name.lower() not in self.used and len(name) > 3:
                self.used.add(name.lower())
                return name

    def person(self) -> str:
        return f"{self()} {self()}"


@dataclass
class _Record:
    """Fact paragraphs to weave into the filler, each tagged with the questions it serves."""

    facts: list[tuple[str, tuple[str, ...]]]
    questions: list[tuple[str, str, str, tuple[str, ...], tuple[str, ...], tuple[str, ...]]]
    # (id, kind, question, answers, candidates, distractors)
    kinds: list[str] = field(default_factory=list)  # each fact's kind, which `kind` names while it is written
    kind: str = ""
    phrasing: str = "shipped"  # or a set of PHRASINGS: the questions in other words

    def fact(self, text: str, *served: str) -> None:
        self.facts.append((text, served))
        self.kinds.append(self.kind)

    def ask(self, template: str, question: tuple[Any, ...], **fields: str) -> None:
        """Record `question` (id, kind, text, answers, candidates, distractors); with another
        phrasing its text is one of that set's `template`s in its words (`fields`), chosen by the
        id, so the record and the document stay as they are."""
        if self.phrasing != "shipped":
            qid = question[0]
            text = random.Random(f"{qid}/{self.phrasing}").choice(PHRASINGS[self.phrasing][template]).format(**fields)
            question = (qid, question[1], text, *question[3:])
        self.questions.append(question)


def _count(rec: _Record, rng: random.Random, names: _Names, qid: str) -> None:
    ship, other, port, others = names(), names(), names(), [names(), names()]
    count = rng.randint(3, 7)
    docking = (
        "In the season of {c} the {s} docked at {p}, laden with {c}.",
        "The {s} put in at {p} once more, her crew weary from the crossing.",
        "Word came to the harbour that the {s} had docked at {p} with a cargo of {c}.",
    )
    for _ in range(count):
        rec.fact(rng.choice(docking).format(s=ship, p=port, c=rng.choice(_CARGO)), qid)
    for _ in range(2):
        rec.fact(rng.choice(docking).format(s=ship, p=rng.choice(others), c=rng.choice(_CARGO)))
        rec.fact(rng.choice(docking).format(s=other, p=port, c=rng.choice(_CARGO)))
    question = rng.choice(
        (
            f"How many times did the {ship} dock at {port}?",
            f"How often did the ship {ship} put in at {port}? Give the number.",
            f"Count the times the {ship} docked at {port}.",
        )
    )
    rec.ask("count", (qid, "count", question, (str(count), _NUMBERS[count]), (), ()), ship=ship, port=port)


def _list(rec: _Record, rng: random.Random, names: _Names, qid: str) -> None:
    envoy, other = names.person(), names.person()
    towns = [names() for _ in range(rng.randint(3, 5))]
    sailing = (
        "The envoy {e} sailed to {t} to treat with its council.",
        "{e} reached {t} after a long crossing, bearing letters for its elders.",
        "It was to {t} that the envoy {e} sailed next.",
    )
    for town in towns:
        rec.fact(rng.choice(sailing).format(e=envoy, t=town), qid)
    elsewhere = [names() for _ in range(2)]
    for town in elsewhere:
        rec.fact(rng.choice(sailing).format(e=other, t=town))
    question = rng.choice(
        (
            f"Name every town the envoy {envoy} sailed to.",
            f"List all the towns that {envoy} visited as envoy.",
            f"To which towns did the envoy {envoy} sail? Name them all.",
        )
    )
    rec.ask("list", (qid, "list", question, tuple(towns), (), tuple(elsewhere)), envoy=envoy)


def _first_last(rec: _Record, rng: random.Random, names: _Names, qid: str) -> None:
    port, other = names(), names()
    holders = [names.person() for _ in range(rng.randint(3, 5))]
    year = rng.randint(1200, 1600)
    appointed = (
        "In the year {y}, {h} was appointed harbourmaster of {p}.",
        "{h} took up the post of harbourmaster of {p} in {y}.",
        "The council of {p} named {h} its harbourmaster in {y}.",
    )
    for holder in holders:
        year += rng.randint(3, 15)
        rec.fact(rng.choice(appointed).format(y=year, h=holder, p=port), qid)
    rec.fact(rng.choice(appointed).format(y=year + 2, h=names.person(), p=other))
    first = rng.random() < 0.5
    word = "first" if first else "last"
    question = rng.choice(
        (
            f"Who was the {word} person appointed harbourmaster of {port}?",
            f"Of all the harbourmasters of {port}, who was appointed {word}?",
        )
    )
    answer = holders[0] if first else holders[-1]
    rec.ask(word, (qid, "first_last", question, (answer,), tuple(holders), ()), port=port)


def _compare(rec: _Record, rng: random.Random, names: _Names, qid: str) -> None:
    a, b, port = names(), names(), names()
    times_a, times_b = rng.sample(range(2, 6), 2)
    coming = (
        "The {s} came into {p} on the morning tide.",
        "At dusk the {s} was seen entering the harbour of {p}.",
        "The {s} arrived at {p} and unloaded there.",
    )
    visits = [a] * times_a + [b] * times_b
    rng.shuffle(visits)
    for ship in visits:
        rec.fact(rng.choice(coming).format(s=ship, p=port), qid)
    question = rng.choice(
        (
            f"Which ship came to {port} more often, the {a} or the {b}?",
            f"Did the {a} or the {b} visit {port} more times?",
        )
    )
    rec.ask("compare", (qid, "compare", question, (a if times_a > times_b else b,), (a, b), ()), a=a, b=b, port=port)


def _two_hop(rec: _Record, rng: random.Random, names: _Names, qid: str) -> None:
    trades = rng.sample(_TRADES, 2)
    families = []
    for index, trade in enumerate(trades):  # the second family is a distractor
        child, mother = names.person(), names.person()
        families.append((child, mother, trade))
        served = (qid,) if index == 0 else ()
        rec.fact(
            rng.choice(("{c} was the daughter of {m}.", "{m} had one child, a daughter named {c}.")).format(c=child, m=mother),
            *served,
        )
        rec.fact(rng.choice(("{m} worked all her life as a {t}.", "By trade {m} was a {t}.")).format(m=mother, t=trade), *served)
    child, _, trade = families[0]
    question = rng.choice((f"What was the trade of {child}'s mother?", f"What work did the mother of {child} do?"))
    rec.ask("two_hop", (qid, "two_hop", question, (trade,), (), (families[1][2],)), child=child)


def _order(rec: _Record, rng: random.Random, names: _Names, qid: str) -> None:
    traveller = names.person()
    figures = rng.sample(_FIGURES, 3)
    meeting = (
        "On the road {v} met the {f}, who asked the way.",
        "{v} fell in with the {f} at the crossroads.",
        "At an inn {v} first met the {f}.",
    )
    for figure in figures:
        rec.fact(rng.choice(meeting).format(v=traveller, f=figure), qid)
    asked = figures
    while asked == figures:  # never asked in the order met: repeating the question is no answer
        asked = rng.sample(figures, 3)
    question = rng.choice(
        (
            f"In what order did {traveller} meet the {asked[0]}, the {asked[1]} and the {asked[2]}?",
            f"{traveller} met the {asked[0]}, the {asked[1]} and the {asked[2]}. In which order?",
        )
    )
    rec.ask("order", (qid, "order", question, tuple(figures), (), ()), traveller=traveller, a=asked[0], b=asked[1], c=asked[2])


def _lookalike(rec: _Record, rng: random.Random, names: _Names, qids: tuple[str, str]) -> None:
    firsts, surnames = [names() for _ in range(2)], [names() for _ in range(2)]
    trades, streets = rng.sample(_TRADES, 2), rng.sample(_STREETS, 2)
    people = [
        (f, i, s, t, st) for f in firsts for i in rng.sample("BJKMRT", 2) for s in surnames for t in trades for st in streets
    ]
    people = rng.sample(people, 8)
    bequests = rng.sample(_BEQUESTS, len(people))
    leaving = (
        "{f} {i}. {s}, the {t} of {st}, left a {b} to the parish.",
        "To the parish, {f} {i}. {s}, {t} of {st}, bequeathed a {b}.",
    )
    facts = {}
    for person, bequest in zip(people, bequests, strict=True):
        f, i, s, t, st = person
        facts[person] = len(rec.facts)
        rec.fact(rng.choice(leaving).format(f=f, i=i, s=s, t=t, st=st, b=bequest))
    for qid, index in zip(qids, rng.sample(range(len(people)), 2), strict=True):
        f, i, s, t, st = people[index]
        rec.facts[facts[people[index]]] = (rec.facts[facts[people[index]]][0], (qid,))
        question = rng.choice(
            (
                f"What did {f} {i}. {s}, the {t} of {st}, leave to the parish?",
                f"Which bequest did the {t} {f} {i}. {s} of {st} make to the parish?",
            )
        )
        others = tuple(b for b in bequests if b != bequests[index])
        fields = {"first": f, "initial": i, "surname": s, "trade": t, "street": st}
        rec.ask("lookalike", (qid, "lookalike", question, (bequests[index],), (), others), **fields)


def _filler(name: str, corpus_dir: Path) -> str:
    if not (corpus_dir / name).is_file():
        fetch(corpus_dir)
    return (corpus_dir / name).read_text(encoding="utf-8", errors="replace")


def generate(seed: int, tokens: int, filler_name: str, corpus_dir: Path = DEFAULT_DIR, phrasing: str = "shipped") -> Document:
    """A document of about `tokens` tokens: filler from `filler_name` (repeated if short) with one
    record's facts at random paragraph breaks, and its questions (in `phrasing`'s words)."""
    rng = random.Random(seed)
    source = _filler(filler_name, corpus_dir)
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", source) if p.strip()]
    if len(paragraphs) < 200:  # a text without blank lines between its paragraphs: its lines
        paragraphs = [line.strip() for line in source.splitlines() if line.strip()]
    names = _Names(rng, source)
    rec = _Record([], [], phrasing=phrasing)
    name = f"record-{seed}-{tokens // 1024}k"
    for kind, write in (("count", _count), ("list", _list), ("first_last", _first_last), ("compare", _compare)):
        rec.kind = kind
        write(rec, rng, names, f"{name}-{kind}")
    rec.kind = "two_hop"
    _two_hop(rec, rng, names, f"{name}-two_hop")
    rec.kind = "order"
    _order(rec, rng, names, f"{name}-order")
    rec.kind = "lookalike"
    _lookalike(rec, rng, names, (f"{name}-lookalike-1", f"{name}-lookalike-2"))
    budget = int(tokens * CHARS_PER_TOKEN)
    start = rng.randrange(len(paragraphs))
    body: list[str] = []
    while sum(len(p) + 2 for p in body) < budget:
        body.append(paragraphs[(start + len(body)) % len(paragraphs)])
    slots = _slots(rec, rng, len(body), f"{name}-two_hop")
    by_slot = sorted(range(len(rec.facts)), key=lambda i: (slots[i], i))
    text_parts: list[str] = []
    spans: dict[str, list[tuple[int, int]]] = {}
    position, next_fact = 0, 0
    for index, paragraph in enumerate(body):
        while next_fact < len(by_slot) and slots[by_slot[next_fact]] == index:
            fact, served = rec.facts[by_slot[next_fact]]
            for qid in served:
                spans.setdefault(qid, []).append((position, position + len(fact)))
            text_parts.append(fact)
            position += len(fact) + 2
            next_fact += 1
        text_parts.append(paragraph)
        position += len(paragraph) + 2
    text = "\n\n".join(text_parts)
    questions = tuple(
        Question(qid, kind, question, answers, candidates, tuple(spans.get(qid, ())), distractors)
        for qid, kind, question, answers, candidates, distractors in rec.questions
    )
    return Document(name, text, questions)


def _slots(rec: _Record, rng: random.Random, paragraphs: int, two_hop: str) -> list[int]:
    """The paragraph each fact goes before (never the first): each kind's facts at random places of
    their own, in record order, so the kinds interleave; the two-hop question's link and trade at
    least a quarter of the paragraphs apart."""
    slots = [0] * len(rec.facts)
    for kind in dict.fromkeys(rec.kinds):
        mine = [i for i, k in enumerate(rec.kinds) if k == kind]
        for i, slot in zip(mine, sorted(rng.choices(range(1, paragraphs), k=len(mine))), strict=True):
            slots[i] = slot
    link, trade = [i for i, (_, served) in enumerate(rec.facts) if two_hop in served]
    apart = paragraphs // 4
    slots[link] = rng.randrange(1, paragraphs - apart)
    slots[trade] = rng.randrange(slots[link] + apart, paragraphs)
    return slots


def _named(answer: str, name: str) -> int:
    """Where `name` first stands in `answer` as words (any case, any spacing); -1 where it does not."""
    pattern = r"\s+".join(re.escape(word) for word in name.split())
    match = re.search(rf"(?<![^\W_]){pattern}(?![^\W_])", answer, re.IGNORECASE)
    return match.start() if match else -1


def _keyword_at(answer: str, keyword: str) -> int:
    """Where `keyword` first stands in `answer` as a word (a plural "s" allowed), any case; -1 where it does not."""
    pattern = r"\s+".join(re.escape(word) for word in keyword.split())
    match = re.search(rf"(?<![^\W_]){pattern}(?:s|es)?(?![^\W_])", answer, re.IGNORECASE)
    return match.start() if match else -1


def grade(question: Question, answer: str) -> bool:
    """Whether `answer` is right by its kind's rule (the module's docstring; the hand-written
    questions of research/evals/wholebook.py: `book_any` one keyword, `book_all` every keyword,
    `book_order` every keyword in the listed order)."""
    if question.kind.startswith("book_"):
        found = [_keyword_at(answer, keyword) for keyword in question.answers]
        if question.kind == "book_any":
            return any(at >= 0 for at in found)
        return all(at >= 0 for at in found) and (question.kind == "book_all" or found == sorted(found))
    if question.kind == "count":
        first = re.search(r"\b(\d+|" + "|".join(_NUMBERS) + r")\b", answer, re.IGNORECASE)
        return first is not None and first.group(1).lower() in question.answers
    if question.kind in ("first_last", "compare"):
        places = {name: _named(answer, name) for name in question.candidates}
        named = [name for name, at in sorted(places.items(), key=lambda pair: pair[1]) if at >= 0]
        return bool(named) and named[0] == question.answers[0]
    if question.kind == "order":
        positions = [_named(answer, name) for name in question.answers]
        return all(at >= 0 for at in positions) and positions == sorted(positions)
    if any(_named(answer, name) >= 0 for name in question.distractors):
        return False  # a hedge that names a wrong one too
    if question.kind == "list":
        return all(_named(answer, name) >= 0 for name in question.answers)
    return any(_named(answer, name) >= 0 for name in question.answers)


# ---- the benchmark: each document ingested once per memory, its questions asked through the engine

ANSWER_TOKENS = 64


@dataclass
class KindRow:
    """One memory's results: per kind [correct, asked], fact recall, timings, prompt sizes."""

    memory: str
    options: dict[str, Any]
    kinds: dict[str, list[int]] = field(default_factory=dict)
    recalled: int = 0  # questions whose retrieval held every fact passage
    ttfts: list[float] = field(default_factory=list)
    totals: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)

    def add(self, kind: str, correct: bool) -> None:
        tally = self.kinds.setdefault(kind, [0, 0])
        tally[0] += correct
        tally[1] += 1

    def summary(self) -> dict[str, Any]:
        correct, asked = sum(c for c, _ in self.kinds.values()), sum(n for _, n in self.kinds.values())
        low, high = wilson(correct, asked)
        out: dict[str, Any] = {
            "memory": self.memory + (f" {json.dumps(self.options)}" if self.options else ""),
            "accuracy": f"{correct}/{asked} = {correct / max(1, asked):.2f} [{low:.2f}, {high:.2f}]",
        }
        order = [*KINDS, "book_any", "book_all", "book_order"]
        out.update({kind: f"{c}/{n}" for kind, (c, n) in sorted(self.kinds.items(), key=lambda kv: order.index(kv[0]))})
        out["all facts in prompt"] = f"{self.recalled}/{asked}" if self.memory != ORACLE else "-"
        out["TTFT median (s)"] = f"{statistics.median(self.ttfts):.2f}" if self.ttfts else "-"
        out["total median (s)"] = f"{statistics.median(self.totals):.2f}" if self.totals else "-"
        out["prompt tokens median"] = f"{statistics.median(self.prompt_tokens):.0f}" if self.prompt_tokens else "-"
        return out


def _holds(items: list[RetrievedItem], facts: tuple[tuple[int, int], ...]) -> bool:
    """Every fact inside a passage of the document's own text (a summary covers a span it does not quote)."""
    quoted = [item for item in items if item.gathered != "summary"]
    return all(any(item.char_start <= a and b <= item.char_end for item in quoted) for a, b in facts)


async def summarized(engine: Engine, session_id: str) -> float:
    """Wait while the session's summaries are being written (text memory with `summarize`); the seconds waited."""
    started = time.perf_counter()
    while engine.cache_info(session_id).summary_state == "building":
        await asyncio.sleep(1.0)
    return time.perf_counter() - started


async def _ask(engine: Engine, row: KindRow, document: Document, question: Question, session_id: str | None) -> None:
    params = GenerationParams(max_tokens=ANSWER_TOKENS)
    if session_id is None:  # the oracle: every fact passage, in document order
        pieces = [
            ContextPiece(
                document.text[a:b], RetrievedItem(chunk_id=0, document_id=document.name, char_start=a, char_end=b, score=1.0)
            )
            for a, b in question.facts
        ]
        events = await engine.chat([{"role": "user", "content": with_context(question.question, pieces)}], params, None, None)
    else:
        events = await engine.ask(session_id, question.question, params)
    parts: list[str] = []
    async for event in events:
        if isinstance(event, Retrieval):
            row.recalled += _holds(list(event.items), question.facts)
        elif isinstance(event, TokenDelta):
            parts.append(event.text)
        elif isinstance(event, GenerationDone):
            row.ttfts.append(event.ttft_seconds)
            row.totals.append(event.total_seconds)
            row.prompt_tokens.append(event.prompt_tokens)
    answer = " ".join("".join(parts).split())
    correct = grade(question, answer)
    row.add(question.kind, correct)
    if not correct:
        row.missed.append(f"{question.id}: {question.question} -> {answer[:100]!r} (want {question.answers})")


def documents(
    seeds: tuple[int, ...],
    lengths: tuple[int, ...],
    fillers: tuple[str, ...],
    corpus_dir: Path = DEFAULT_DIR,
    phrasing: str = "shipped",
) -> list[Document]:
    """One document per (length, seed), the seed's filler taken in turn from `fillers`."""
    return [
        generate(seed, length, fillers[i % len(fillers)], corpus_dir, phrasing)
        for length in lengths
        for i, seed in enumerate(seeds)
    ]


def bench(setup: EvalSetup, runs: list[tuple[str, dict[str, Any]]], docs: list[Document]) -> list[KindRow]:
    """One row per (memory, options), over every question of `docs`; "oracle" is the reader handed the facts."""

    async def body(engine: Engine) -> list[KindRow]:
        rows = []
        for memory, options in runs:
            row = KindRow(memory, options)
            for document in docs:
                if memory == ORACLE:
                    for question in document.questions:
                        await _ask(engine, row, document, question, None)
                    continue
                session = engine.create_session(None, memory, options)
                row.options = dict(session.options)
                try:
                    async for _ in await engine.ingest(session.id, document.text, document.name):
                        pass
                    waited = await summarized(engine, session.id)
                    cache = engine.cache_info(session.id)
                    if cache.summary_state is not None:
                        print(
                            f"  {document.name}: {cache.summaries} summaries, {cache.summary_state}, {waited:.0f} s after ingestion",
                            flush=True,
                        )
                    for question in document.questions:
                        await _ask(engine, row, document, question, session.id)
                finally:
                    engine.delete_session(session.id)
                print(f"  {memory} {document.name}: {row.summary()['accuracy']}", flush=True)
            rows.append(row)
        return rows

    return run_with_engine(setup, 200_000, body)
