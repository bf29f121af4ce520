"""The QA benchmark and the fact needles: scoring, intervals, gold spans, and a run on the tiny model."""

from __future__ import annotations

import json
import shutil
from itertools import pairwise

import pytest

from engine.interface import RetrievedItem
from research.evals import needles, ranks, texts
from research.evals.qa import DEV_QUESTIONS, QUESTIONS, bench, is_correct, load_questions, overlaps, wilson
from research.training.evaluate import EvalSetup
from tests.helpers import CACHE_DIR


def test_an_answer_is_correct_when_a_keyword_appears_as_a_word():
    assert is_correct("It was Elsie.", ["elsie", "lacie"])
    assert is_correct("Conger eels taught them", ["eel"])  # a plural counts
    assert not is_correct("I feel nothing", ["eel"])  # inside another word does not
    assert not is_correct("the Sultanate of Zanzibar", ["Sultana"])
    assert is_correct("ZQ-2208 opens it", ["ZQ-2208"]) and not is_correct("ZQ-22089", ["ZQ-2208"])


def test_wilson_interval():
    assert wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson(110, 110)[1] == 1.0


@pytest.mark.parametrize(("path", "specs", "least"), [(QUESTIONS, texts.TEXTS, 80), (DEV_QUESTIONS, texts.DEV_TEXTS, 30)])
def test_the_shipped_questions_are_well_formed(path, specs, least):
    """The held-out questions and the development ones, each about its own texts only (the spans
    are checked against the texts themselves when `load_questions` reads them)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) >= least and len({r["id"] for r in rows}) == len(rows)
    assert {r["text"] for r in rows} == {t.name for t in specs}
    for r in rows:
        assert r["end"] - r["start"] == len(r["passage"]) and r["answers"]
        assert is_correct(r["passage"], r["answers"]), r["id"]  # the gold passage holds an accepted answer
        assert not is_correct(r["question"], r["answers"]), r["id"]  # the question does not give it away


def _tiny_set(tmp_path):
    qa_dir = tmp_path / "qa"
    qa_dir.mkdir()
    body = "The weather was mild. " * 200
    text = body + "The ferryman of the lake was called Quennell Ardmore. " + body
    for spec in texts.TEXTS:
        (qa_dir / f"{spec.name}.txt").write_text(text)
    start = text.index("The ferryman")
    passage = text[start : start + 53]
    question = {
        "id": "alice-01",
        "text": "alice",
        "question": "Who was the ferryman of the lake?",
        "answers": ["Quennell"],
        "start": start,
        "end": start + len(passage),
        "passage": passage,
    }
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps(question) + "\n")
    return qa_dir, path, question


def test_a_gold_span_that_no_longer_holds_its_passage_is_refused(tmp_path):
    qa_dir, path, _ = _tiny_set(tmp_path)
    (qa_dir / "alice.txt").write_text("something else entirely " * 100)
    with pytest.raises(ValueError, match="gold span"):
        load_questions(path, qa_dir)


def test_recall_counts_retrieved_spans_that_touch_the_gold_passage(tmp_path):
    item = lambda a, b: RetrievedItem(chunk_id=0, document_id="d", char_start=a, char_end=b, score=None)  # noqa: E731
    assert overlaps([item(0, 101)], 100, 200) and overlaps([item(199, 300)], 100, 200)
    assert not overlaps([item(0, 100), item(200, 300)], 100, 200)


def test_the_benchmark_runs_every_memory_and_the_oracle_on_the_tiny_model(tiny_dir, tmp_path):
    qa_dir, path, _ = _tiny_set(tmp_path)
    setup = EvalSetup(model=str(tiny_dir), cache_dir=CACHE_DIR, device="cpu")
    rows = bench(setup, [("oracle", {}), ("text", {"top_k": 2}), ("truncate", {})], qa_dir=qa_dir, questions_path=path)
    assert [r.memory for r in rows] == ["oracle", "text", "truncate"] and all(r.asked == 1 for r in rows)
    oracle, text, truncate = rows
    assert text.recalled == 1  # BM25 finds the rare name
    assert oracle.recalled is None and truncate.recalled is None and oracle.ingest_seconds == 0
    assert text.ingest_tokens > 0 and len(text.ttfts) == 1
    assert len(text.missed) == 1 - text.correct  # a random tiny model: whatever it missed is listed
    assert text.summary()["accuracy"].startswith(f"{text.correct}/1 = ")
    assert text.summary()["gold recall"] == "1/1 = 1.00"  # a count, not only a rounded share
    assert oracle.summary()["gold recall"] == "-"


def test_ranks_place_the_gold_passage_among_the_chunks_retrieval_takes(tiny_dir, tmp_path):
    """recall@k from the place of the first chunk that meets the gold span; BM25 puts the rare name first."""
    assert ranks.gold_rank([(0, 10), (50, 60), (95, 120)], 100, 200) == 2
    assert ranks.gold_rank([(0, 100), (200, 300)], 100, 200) is None  # touching is not meeting
    qa_dir, path, _ = _tiny_set(tmp_path)
    setup = EvalSetup(model=str(tiny_dir), cache_dir=CACHE_DIR, device="cpu")
    rows = ranks.bench(setup, [{}, {"retrieval": "lexical", "chunk_tokens": 32}], questions_path=path, qa_dir=qa_dir)
    assert [r.ranks for r in rows] == [[0], [0]] and len(rows[0].seconds) == 1
    summary = rows[1].summary()
    assert summary["memory"] == 'text {"retrieval": "lexical", "chunk_tokens": 32}' and summary["recall@1"] == "1.00"
    assert ranks.RankRow("text", {}, ranks=[0, 3, None, 20]).summary()["recall@4"] == "0.50"
    assert rows[0].gaps[0][0] == 0.0 and all(a <= b for a, b in pairwise(rows[0].gaps[0]))  # below the first, growing


def test_a_margin_counts_the_excerpts_it_would_keep_and_the_golds_among_them():
    gaps = [[0.0, 0.5, 1.0, 3.0, 4.0], [0.0, 2.5, 2.6, 2.7, 2.8], [0.0, 0.1, 0.2, 0.3, 0.4]]
    row = ranks.RankRow("text", {"top_k": 4}, ranks=[3, 0, None], gaps=gaps)
    assert row.with_margin(2.0) == {
        "memory": 'text {"top_k": 4}',
        "margin": "2",
        "chunks a question (mean)": "2.67",
        "gold among them": "1/3",
    }
    assert row.with_margin(3.0)["gold among them"] == "2/3" and row.with_margin(3.0)["chunks a question (mean)"] == "4.00"
    ranked = ranks.RankRow("text", {"top_k": 4, "fusion": "rank"}, ranks=[3, 0, None], gaps=gaps)
    assert ranked.with_margin(2.0)["chunks a question (mean)"] == "4.00"  # inert where scores are not z-scores


def test_a_row_names_the_options_its_sessions_were_made_with(tiny_dir, tmp_path):
    """The model manifest's options under the run's own, as the session merged them."""
    qa_dir, path, _ = _tiny_set(tmp_path)
    measured = tmp_path / tiny_dir.name
    shutil.copytree(tiny_dir, measured)
    (measured / "longdoc.json").write_text(json.dumps({"memory_options": {"text": {"top_k": 2, "chunk_tokens": 64}}}))
    setup = EvalSetup(model=str(measured), cache_dir=CACHE_DIR, device="cpu")
    (row,) = bench(setup, [("text", {"chunk_tokens": 32})], qa_dir=qa_dir, questions_path=path)
    assert row.options == {"top_k": 2, "chunk_tokens": 32}
    (ranked,) = ranks.bench(setup, [{"chunk_tokens": 32}], questions_path=path, qa_dir=qa_dir)
    assert ranked.summary()["memory"] == 'text {"top_k": 2, "chunk_tokens": 32}'


def test_needles_are_placed_once_each_at_spread_depths(tiny_tokenizer, tmp_path):
    (tmp_path / "jargon-d-z.txt").write_text("   A hacker wrote a program.\n\n" * 3000)
    text, placed = needles.document(2000, tiny_tokenizer, seed=1, qa_dir=tmp_path)
    assert sorted(n.kind for n in placed) == sorted(needles.KINDS) and len(needles.KINDS) >= 6
    positions = [text.index(n.fact) for n in placed]
    assert positions == sorted(positions) and all(text.count(n.fact) == 1 for n in placed)
    assert [int(n.depth * len(placed)) for n in placed] == list(range(len(placed)))  # one in each sixth
    for n in placed:
        assert is_correct(n.fact, n.answers) and not is_correct(n.question, n.answers)
    again, _ = needles.document(2000, tiny_tokenizer, seed=1, qa_dir=tmp_path)
    other, _ = needles.document(2000, tiny_tokenizer, seed=2, qa_dir=tmp_path)
    assert again == text and other != text
    assert all(len(phrasings) >= 3 for phrasings, _ in needles.KINDS.values())
