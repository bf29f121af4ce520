"""The whole-document benchmark's generator and grading (research/evals/wholedoc.py), and the text
memory's gathering on what it generates."""

from __future__ import annotations

import re
import string
from dataclasses import replace

from engine.memories.text.gather import gather
from research.evals.wholedoc import KINDS, PHRASINGS, Question, generate, grade
from tests.helpers import FIXTURES


def test_a_document_holds_every_kind_and_its_facts():
    document = generate(7, 8192, "alice29.txt", FIXTURES)
    assert 30_000 < len(document.text) < 40_000
    assert {q.kind for q in document.questions} == set(KINDS) and len(document.questions) == len(KINDS) + 1
    for question in document.questions:
        assert question.facts, question.id
        assert all(document.text[a:b].strip() and "\n" not in document.text[a:b] for a, b in question.facts)
        assert [a for a, _ in question.facts] == sorted(a for a, _ in question.facts)
    count = next(q for q in document.questions if q.kind == "count")
    assert len(count.facts) == int(count.answers[0])
    assert generate(8, 8192, "alice29.txt", FIXTURES).text != document.text


def test_generated_records_are_gathered_whole_and_alike_twice():
    for seed in (1, 2, 3):
        document = generate(seed, 8192, "alice29.txt", FIXTURES)
        assert document == generate(seed, 8192, "alice29.txt", FIXTURES)  # deterministic
        for question in document.questions:
            first = gather([document.text], question.question, 2048, 256)
            assert first == gather([document.text], question.question, 2048, 256)
            got = {(s.start, s.end) for s in first[1]}
            assert set(question.facts) <= got, question.id


def test_reworded_questions_are_gathered_whole_where_their_names_recur():
    missed = 0
    for seed in (1, 2, 3):
        document = generate(seed, 8192, "alice29.txt", FIXTURES, "reworded")
        for question in document.questions:
            # every form read as a whole-document one: the rule on recurring names alone
            _, sentences = gather([document.text], question.question, 768, 256, recurring=lambda asked, names, strict: True)
            assert set(question.facts) <= {(s.start, s.end) for s in sentences}, question.question
            _, without = gather([document.text], question.question, 768, 256)
            missed += not set(question.facts) <= {(s.start, s.end) for s in without}
    assert missed >= 3  # by their words alone, some of these are local questions and lose their facts


def test_the_kinds_interleave_and_two_hops_stand_far_apart():
    for seed in (1, 2, 3, 101):
        document = generate(seed, 32768, "alice29.txt", FIXTURES)
        placed = sorted((a, KINDS.index(q.kind)) for q in document.questions for a, _ in q.facts)
        kinds = [kind for _, kind in placed]
        assert kinds != sorted(kinds), seed  # not every count fact first and every look-alike last
        two_hop = next(q for q in document.questions if q.kind == "two_hop")
        link, trade = two_hop.facts
        blocks = document.text.count("\n\n") + 1
        between = document.text[link[0] : trade[0]].count("\n\n")
        assert between >= (blocks - 48) // 4, (seed, between, blocks)  # 48: the most facts a record has
        (other,) = two_hop.distractors  # the other family's trade, stated in the record
        assert other != two_hop.answers[0] and f"a {other}." in document.text
        order = next(q for q in document.questions if q.kind == "order")
        asked = sorted(order.answers, key=order.question.index)
        assert tuple(asked) != order.answers, seed  # repeating the question is no answer


def test_other_phrasings_ask_the_same_records_in_other_words():
    for seed in (1, 101):
        shipped = generate(seed, 8192, "alice29.txt", FIXTURES)
        for phrasing in PHRASINGS:
            other = generate(seed, 8192, "alice29.txt", FIXTURES, phrasing)
            assert other.text == shipped.text and other == generate(seed, 8192, "alice29.txt", FIXTURES, phrasing)
            for mine, theirs in zip(other.questions, shipped.questions, strict=True):
                assert mine.question != theirs.question and replace(mine, question=theirs.question) == theirs
                if mine.kind in ("order", "lookalike", "compare"):  # the same names as the shipped wording gives
                    names = set(re.findall(r"\b[A-Z][a-z]+\b", theirs.question)) - {"In", "What", "Which", "Did"}
                    assert names <= set(re.findall(r"\b[A-Z][a-z]+\b", mine.question)), (phrasing, mine.question)
    # every template of every set takes exactly the fields its kind records (`_Record.ask`'s callers)
    fields = {
        "count": {"ship", "port"},
        "list": {"envoy"},
        "first": {"port"},
        "last": {"port"},
        "compare": {"a", "b", "port"},
        "two_hop": {"child"},
        "order": {"traveller", "a", "b", "c"},
        "lookalike": {"first", "initial", "surname", "trade", "street"},
    }
    for templates in PHRASINGS.values():
        assert templates.keys() == fields.keys()
        for key, each in templates.items():
            for template in each:
                assert {name for _, name, _, _ in string.Formatter().parse(template) if name} == fields[key], template


def question(
    kind: str, answers: tuple[str, ...], candidates: tuple[str, ...] = (), distractors: tuple[str, ...] = ()
) -> Question:
    return Question("q", kind, "?", answers, candidates, ((0, 1),), distractors)


def test_grading_rules():
    count = question("count", ("4", "four"))
    assert grade(count, "The Veridian docked there 4 times.") and grade(count, "Four times.")
    assert not grade(count, "It docked 3 times, then 4 more.")
    listing = question("list", ("Carrow", "Tull"))
    assert grade(listing, "He sailed to carrow and Tull.") and not grade(listing, "Carrow only.")
    first = question("first_last", ("Ann Bell",), ("Ann Bell", "Cora Dale"))
    assert grade(first, "Ann Bell was first, then Cora Dale.") and not grade(first, "Cora Dale, after Ann Bell.")
    order = question("order", ("Archivist", "Ferryman", "Weaver"))
    assert grade(order, "the Archivist, then the Ferryman, then the Weaver")
    assert not grade(order, "the Ferryman, the Archivist, the Weaver") and not grade(order, "the Archivist and the Weaver")
    bequest = question("lookalike", ("font",), distractors=("organ", "bell"))
    assert grade(bequest, "He left a font.") and not grade(bequest, "He left a fountain.")
    assert not grade(bequest, "He left a font, or perhaps the organ.")
    towns = question("list", ("Carrow", "Tull"), distractors=("Brin",))
    assert grade(towns, "Carrow and Tull.") and not grade(towns, "Carrow, Tull and Brin.")
    trade = question("two_hop", ("potter",), distractors=("tanner",))
    assert grade(trade, "She was a potter.") and not grade(trade, "A potter or a tanner.")


def test_hand_written_whole_book_questions_are_well_formed():
    import json

    from research.evals.wholebook import QUESTIONS

    rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    assert len(rows) >= 40 and len({row["id"] for row in rows}) == len(rows)
    assert {row["text"] for row in rows} == {"alice", "paradise-lost", "acts"}
    alice = FIXTURES.joinpath("alice29.txt").read_text()  # the QA benchmark's alice is the whole file
    for row in rows:
        assert row["rule"] in ("any", "all") and row["answers"] and 1 <= len(row["evidence"]) <= 8, row["id"]
        if row["text"] == "alice":
            places = [alice.find(quote) for quote in row["evidence"]]
            assert all(at >= 0 for at in places) and places == sorted(places), row["id"]


def test_development_whole_book_questions_are_well_formed_and_on_development_texts():
    import json
    import re

    from research.evals.texts import DEV_TEXTS
    from research.evals.wholebook import DEV_QUESTIONS

    rows = [json.loads(line) for line in DEV_QUESTIONS.read_text().splitlines() if line.strip()]
    assert len(rows) >= 20 and len({row["id"] for row in rows}) == len(rows)
    assert {row["text"] for row in rows} <= {spec.name for spec in DEV_TEXTS}
    for row in rows:
        assert row["rule"] in ("any", "all") and row["answers"] and 1 <= len(row["evidence"]) <= 8, row["id"]
        # no answer given away by its own question
        assert not any(re.search(rf"\b{re.escape(word)}\b", row["question"], re.IGNORECASE) for word in row["answers"]), row["id"]


def test_book_questions_grade_by_their_rule():
    assert grade(question("book_any", ("dream", "dreaming")), "It was all a dream.")
    assert not grade(question("book_all", ("Hatter", "Dormouse")), "The Hatter was there.")
    assert grade(question("book_order", ("Mouse", "Caterpillar")), "First the mouse, then the Caterpillar.")
    assert not grade(question("book_order", ("Mouse", "Caterpillar")), "The Caterpillar, then the Mouse.")


def test_the_eval_keeps_development_and_held_out_seeds_and_phrasings_apart():
    from typer.testing import CliRunner

    from clients.cli import app

    refusals = {
        ("--seed", "1"): "development ones",
        ("--dev", "--seed", "101"): "held out",
        ("--dev", "--phrasing", "unseen"): "held-out figures only",
        ("--phrasing", "plain"): "shipped or one of",
    }
    for args, reason in refusals.items():
        refused = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["eval", "wholedoc", *args])
        assert refused.exit_code == 2 and reason in refused.output, (args, refused.output)
