"""Gathering from the whole document (engine/memories/text/gather.py): every sentence naming the
question's names, exhaustive, in document order, deterministic; exact names among look-alikes."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from engine.memories.text.gather import beside_names, common_words, gather, is_whole_document, mentions, merged, question_names
from tests.helpers import FIXTURES


def test_question_names_keep_initials_and_drop_question_words():
    assert question_names("What did Aldous K. Ashdown, the cooper of Mill Row, leave to the parish?") == [
        "Aldous K. Ashdown",
        "Mill Row",
    ]
    assert question_names("How many times did the Veridian dock at Carrow?") == ["Veridian", "Carrow"]
    assert question_names("What was the trade of Ilsa Varn's mother?") == ["Ilsa Varn"]
    assert question_names("what is this about?") == []


@pytest.mark.parametrize(
    ("question", "whole"),
    [
        ("How many times did the Veridian dock at Carrow?", True),
        ("Name every town the envoy sailed to.", True),
        ("Who was appointed last?", True),
        ("In what order did she meet them?", True),
        ("Who guards the ford of Lethe?", False),
        ("What was the trade of Ilsa Varn's mother?", False),
    ],
)
def test_whole_document_questions_are_told_apart(question, whole):
    assert is_whole_document(question) is whole


def test_every_mention_in_order_and_no_other():
    text = FIXTURES.joinpath("alice29.txt").read_text()
    found = mentions([text, text[:5000]], ["Dormouse", "Hatter"])
    spans = [(s.document, s.start) for s in found]
    assert spans == sorted(spans) and len(set(spans)) == len(spans)
    for s in found:
        held = text[s.start : s.end]
        assert s.names == {n for n in ("Dormouse", "Hatter") if re.search(rf"\b{n}\b", held)}
    # exhaustive: every occurrence in the book lies in one of the sentences taken
    every = [m.start() for m in re.finditer(r"\b(Dormouse|Hatter)\b", text)]
    assert every and all(any(s.document == 0 and s.start <= at < s.end for s in found) for at in every)


def test_an_initial_does_not_end_a_sentence_and_the_exact_name_wins():
    documents = [
        "Aldous J. Ashdown, the cooper of Mill Row, left a bell to the parish. "
        "Aldous K. Ashdown, the cooper of Tanner Street, left a font to the parish.\n\n"
        "Aldous K. Ashdown, the cooper of Mill Row, left a chalice to the parish. Rain fell."
    ]
    strategy, sentences = gather(documents, "What did Aldous K. Ashdown, the cooper of Mill Row, leave?", 2048, 256)
    assert strategy == "exact"
    texts = [documents[0][s.start : s.end] for s in sentences]
    assert texts == ["Aldous K. Ashdown, the cooper of Mill Row, left a chalice to the parish."]


LOOKALIKES = [
    "Aldous K. Ashdown, the cooper of Mill Row, left a chalice to the parish. The tanner Bran Hollis left a bell.\n\n"
    "To the parish, Aldous K. Ashdown, tanner of Mill Row, bequeathed a font. The parish thanked him."
]


@pytest.mark.parametrize(
    ("question", "kept"),
    [
        ("Tell me what the tanner Aldous K. Ashdown of Mill Row gave the parish.", ["bequeathed a font"]),
        ("Aldous K. Ashdown (cooper, Mill Row) left something to the parish. What?", ["left a chalice"]),
        ("What did Aldous K. Ashdown of Mill Row give the parish?", ["left a chalice", "bequeathed a font"]),
    ],
)
def test_among_sentences_naming_the_same_look_alike_the_one_with_the_question_s_other_words_wins(question, kept):
    """Both sentences hold every name; the trade the question sets beside them tells them apart
    (what it asks of them, "gave the parish", "left something", is not weighed); with no such word,
    both are kept."""
    strategy, sentences = gather(LOOKALIKES, question, 2048, 256)
    assert strategy == "exact"
    texts = [LOOKALIKES[0][s.start : s.end] for s in sentences]
    assert len(texts) == len(kept) and all(part in text for part, text in zip(kept, texts, strict=True))


def test_a_near_tie_of_the_question_s_other_words_keeps_both_look_alikes():
    """The word "old" (twice in the documents) in one sentence against "cooper" (three times) in the other:
    the first weighs more, but not twice as much, so both go to the reader, as without the weighing.
    What the question asks of its names ("left", twice in the documents, in the first sentence) is
    not weighed: weighed, it would leave the second sentence under half the first's weight."""
    documents = [
        "Aldous K. Ashdown, the old tanner of Mill Row, left a chalice to the parish. A cooper came, then a cooper sang.\n\n"
        "To the parish, Aldous K. Ashdown, cooper of Mill Row, bequeathed a font. An old man left."
    ]
    question = "The old cooper Aldous K. Ashdown of Mill Row left what?"
    strategy, sentences = gather(documents, question, 2048, 256)
    assert strategy == "exact" and len(sentences) == 2
    assert beside_names(question, ["Aldous K. Ashdown", "Mill Row"]) == "old cooper Aldous K. Ashdown of Mill Row"


def test_a_word_every_look_alike_holds_tells_none_apart_and_one_left_out_is_no_hop():
    """The word "old" stands in both sentences, so only "tanner" weighs: were "old" weighed too, the cooper's
    sentence would hold half the tanner's weight and stay. The cooper's sentence names Brother
    Cuthwin as the kept one does, yet does not come back as a hop of it."""
    documents = [
        "Aldous K. Ashdown, the old cooper of Mill Row, left a bell to Brother Cuthwin. Rain fell.\n\n"
        "Aldous K. Ashdown, the old tanner of Mill Row, left a font to Brother Cuthwin. The tanner slept."
    ]
    strategy, sentences = gather(documents, "What did the old tanner Aldous K. Ashdown of Mill Row leave?", 2048, 256)
    texts = [documents[0][s.start : s.end] for s in sentences]
    assert strategy == "exact"
    assert texts == ["Aldous K. Ashdown, the old tanner of Mill Row, left a font to Brother Cuthwin."]


def test_two_hops_follow_the_name_the_first_sentences_add():
    documents = ["Ilsa Varn was the daughter of Corra Dene. " + "Nothing happened. " * 400 + "By trade Corra Dene was a tanner."]
    strategy, sentences = gather(documents, "What was the trade of Ilsa Varn's mother?", 2048, 256)
    assert strategy == "lookup"
    assert [documents[0][s.start : s.end] for s in sentences] == [
        "Ilsa Varn was the daughter of Corra Dene.",
        "By trade Corra Dene was a tanner.",
    ]


def test_merged_joins_sentences_that_overlap_ranked_excerpts_and_keeps_document_order():
    from engine.interface import RetrievedItem
    from engine.memories.base import ContextPiece

    def piece(document: str, start: int, end: int) -> ContextPiece:
        return ContextPiece("x", RetrievedItem(chunk_id=0, document_id=document, char_start=start, char_end=end, score=1.0))

    documents = [("a", "abcdefghij" * 10), ("b", "klmnopqrst" * 10)]
    gathered = [piece("b", 5, 9), piece("a", 50, 60), piece("a", 1, 3), piece("a", 78, 90)]
    out = merged(gathered, [piece("a", 40, 80)], documents)
    assert [(p.item.document_id, p.item.char_start, p.item.char_end) for p in out] == [("a", 1, 3), ("a", 40, 90), ("b", 5, 9)]
    assert out[1].text == documents[0][1][40:90]  # the overlapping sentence widened the ranked excerpt: no text twice


def _docking_record() -> tuple[str, list[str], str]:
    """A record of five dockings far apart in filler, and the whole-document question about them."""
    filler = "The weather was mild and nothing of note happened in the town that week. " * 40
    dockings = [f"In spring year {i} the Veridian docked at Carrow with salt." for i in range(5)]
    return (
        filler + " ".join(f"{docking} {filler}" for docking in dockings),
        dockings,
        "How many times did the Veridian dock at Carrow?",
    )


def test_the_text_memory_answers_a_whole_document_question_from_every_mention(tiny_tokenizer, embedder):
    from engine.memories import MemoryContext
    from tests.engine.test_memories import ingest, text_memory

    context = MemoryContext(tokenizer=tiny_tokenizer, embedder=embedder)
    text, dockings, question = _docking_record()
    plain = text_memory(context, {})
    gathering = text_memory(context, {"gather": True})
    for memory in (plain, gathering):
        ingest(memory, tiny_tokenizer, "record", text)
    pieces = gathering.retrieve(question, max_tokens=4096)
    gathered = [p for p in pieces if p.text in dockings]
    assert gathered and all(p.item.gathered == "whole" for p in gathered)
    for docking in dockings:  # every one reaches the reader: gathered, or inside a ranked chunk
        at = text.index(docking)
        assert any(p.item.char_start <= at and at + len(docking) <= p.item.char_end for p in pieces), docking
    assert all(text[p.item.char_start : p.item.char_end] == p.text for p in pieces)
    # beside the ranked chunks, a sentence inside one of them left out (the chunk marked), all in document order
    ranked = plain.retrieve(question, max_tokens=4096)
    assert [replace(p.item, gathered=None) for p in pieces if p.text not in dockings] == [p.item for p in ranked]
    assert any(p.item.gathered == "whole" for p in pieces if p.text not in dockings)
    assert [p.item.char_start for p in pieces] == sorted(p.item.char_start for p in pieces)
    assert len(plain.retrieve(question, max_tokens=4096)) < 5  # top-k chunks: not every mention
    # a question naming nothing the document holds is answered from the ranked chunks, as without gathering
    assert gathering.retrieve("what is the weather like?", 4096) == plain.retrieve("what is the weather like?", 4096)


def test_gather_chunks_bounds_the_ranked_chunks_beside_every_mention(tiny_tokenizer, embedder):
    from engine.memories import MemoryContext
    from tests.engine.test_memories import ingest, text_memory

    context = MemoryContext(tokenizer=tiny_tokenizer, embedder=embedder)
    text, dockings, question = _docking_record()
    memory = text_memory(context, {"gather": True})
    ingest(memory, tiny_tokenizer, "record", text)  # once: no option here changes what ingestion stores
    base, beside = memory.options, {}
    variants: dict[str, dict[str, Any]] = {
        "0": {"gather_chunks": 0},
        "1": {"gather_chunks": 1},
        "top_k": {},
        "top_k 2": {"top_k": 2},
    }
    for name, options in variants.items():
        memory.options = replace(base, **options)
        pieces = memory.retrieve(question, max_tokens=4096)
        for docking in dockings:  # every mention, whatever the chunks: gathered, or inside a ranked chunk
            at = text.index(docking)
            assert any(p.item.char_start <= at and at + len(docking) <= p.item.char_end for p in pieces), docking
        assert [p.item.char_start for p in pieces] == sorted(p.item.char_start for p in pieces)
        beside[name] = sum(p.text not in dockings for p in pieces)
    # unset, the ranked chunks beside a gathering are top_k's (4 by default), as before the option
    assert beside["0"] == 0 and beside["1"] == 1 and 2 < beside["top_k"] <= 4 and 1 <= beside["top_k 2"] <= 2
    # a question without a word of a list: with gather_recurring its five sentences still make a
    # gathering, when its form reads as a whole-document one; a local question about them does not
    reworded, local = "Tell me the harbours the Veridian visited.", "What did the Veridian carry when it docked at Carrow?"
    memory.options = replace(base, gather_chunks=0)
    assert not any(p.item.gathered for p in memory.retrieve(reworded, 4096))
    without = memory.retrieve(local, 4096)
    memory.options = replace(base, gather_chunks=0, gather_recurring=True)
    assert [p.text for p in memory.retrieve(reworded, 4096)] == dockings
    assert memory.retrieve(local, 4096) == without and not any(p.item.gathered for p in without)
    # a local question is ranked as always: gather_chunks bounds only what sits beside a gathering
    memory.options = replace(base, gather_chunks=0)
    none = memory.retrieve("what is the weather like?", 4096)
    memory.options = base
    assert none == memory.retrieve("what is the weather like?", 4096)


def test_gather_options_are_checked():
    from engine.errors import InvalidRequestError
    from engine.memories import check_options

    check_options("text", {"gather": True, "gather_tokens": 1024, "lookup_tokens": 128})
    check_options("text", {"gather_tokens": 128})  # alone, gather off
    with pytest.raises(InvalidRequestError, match="lookup_tokens"):
        check_options("text", {"gather": True, "lookup_tokens": 0})
    with pytest.raises(InvalidRequestError):
        check_options("text", {"gather": "yes"})
    check_options("text", {"gather_recurring": True})
    with pytest.raises(InvalidRequestError, match="gather_recurring"):
        check_options("text", {"gather_recurring": 1})
    check_options("text", {"gather_chunks": None})
    with pytest.raises(InvalidRequestError, match="gather_chunks"):
        check_options("text", {"gather_chunks": -1})
    with pytest.raises(InvalidRequestError, match="gather_chunks"):
        check_options("text", {"gather_chunks": True})


def test_names_used_often_or_mentions_past_the_budget_gather_nothing():
    text = FIXTURES.joinpath("alice29.txt").read_text()
    # hundreds of sentences name Alice: no exhaustive answer fits, and a lookup would be noise
    assert gather([text], "How many times does Alice cry?", 2048, 256) == ("none", [])
    assert gather([text], "What does Alice say to the Caterpillar?", 2048, 256) == ("none", [])
    strategy, sentences = gather([text], "How many times is the Lobster Quadrille named?", 2048, 256)
    assert strategy == "whole" and sentences == mentions([text], ["Lobster Quadrille"])


def test_with_recurring_a_question_whose_names_recur_gets_every_mention_whatever_its_words():
    text = FIXTURES.joinpath("alice29.txt").read_text()
    asked: list[tuple[str, list[str], bool]] = []

    def recurring(question: str, names: list[str], strict: bool) -> bool:  # whether its form reads as a whole-document one
        asked.append((question, names, strict))
        return True

    # no word of a count, list or order: by its words a local question, which a lookup cannot answer
    question = "What does the story tell of Dinah?"
    assert not is_whole_document(question) and gather([text], question, 2048, 256)[0] == "none"
    strategy, sentences = gather([text], question, 2048, 256, recurring=recurring)
    assert strategy == "whole" and sentences == mentions([text], ["Dinah"]) and len(sentences) > 8
    assert asked == [(question, ["Dinah"], False)]  # the plain margin: names that recur
    # a form that reads as a local question: as without `recurring`
    assert gather([text], question, 2048, 256, recurring=lambda question, names, strict: False)[0] == "none"
    # names in different sentences, none holding most of them: every mention, not the longest name's
    documents = [
        "Ilsa Varn met the Ferryman at dawn. Rain fell. Ilsa Varn met the Archivist later. Then Ilsa Varn met the Cartographer."
    ]
    order = "Arrange the Ferryman, the Archivist and the Cartographer by when Ilsa Varn met them."
    assert gather(documents, order, 2048, 256)[0] == "lookup"
    strategy, sentences = gather(documents, order, 2048, 256, recurring=recurring)
    assert strategy == "whole" and len(sentences) == 3
    assert gather(documents, order, 2048, 256, recurring=lambda question, names, strict: False) == gather(
        documents, order, 2048, 256
    )
    # one sentence holding every name a local question gives: a lookup as before, its form not read
    asked.clear()
    assert gather(documents, "Where did Ilsa Varn meet the Ferryman?", 2048, 256, recurring=recurring)[0] == "exact"
    assert not asked
    # a book's main characters still do not fit: the ranked chunks answer
    assert gather([text], "What does Alice say to the Caterpillar?", 2048, 256, recurring=recurring) == ("none", [])


def test_a_few_sentences_all_alike_are_every_mention_only_where_the_form_reads_clearly_whole():
    filler = "The wind came off the sea and the gulls cried over the harbour wall. " * 30
    voyages = (
        "Brenna Holt sailed to Quarry Cove.",
        "Later Brenna Holt sailed to Fennick.",
        "Brenna Holt reached Osterley at last.",
    )
    text = filler.join(voyages) + filler
    question = "Tell me the towns the envoy Brenna Holt visited."  # no word of a list: by its words a local question
    asked: list[bool] = []

    def reads(clearly: bool) -> Callable[[str, list[str], bool], bool]:
        """A form that reads whole clearly (`clearly`), or only at the plain margin."""

        def recurring(question: str, names: list[str], strict: bool) -> bool:
            asked.append(strict)
            return strict if clearly else not strict

        return recurring

    lookup = gather([text], question, 2048, 256)
    assert lookup[0] == "lookup" and len(lookup[1]) == 3  # every sentence naming her, beside ranked chunks
    strategy, sentences = gather([text], question, 2048, 256, recurring=reads(True))
    assert strategy == "whole" and sentences == mentions([text], ["Brenna Holt"]) and asked == [True]
    asked.clear()  # a form that passes the plain margin only: the lookup, as without `recurring`
    assert gather([text], question, 2048, 256, recurring=reads(False)) == lookup and asked == [True]
    # every mention past the budget: the lookup, not nothing
    assert gather([text], question, 12, 256, recurring=reads(True)) == gather([text], question, 12, 256)
    asked.clear()
    # one sentence; look-alikes holding every name the question gives (exact); best sentences beside a
    # weaker one: no strict form read, as before
    assert gather([voyages[0] + " " + filler], question, 2048, 256, recurring=reads(True))[0] == "lookup"
    alike = filler.join(["Brenna Holt reached Osterley by sea.", "Brenna Holt reached Osterley on foot."]) + filler
    assert gather([alike], "When did Brenna Holt reach Osterley?", 2048, 256, recurring=reads(True))[0] == "exact"
    uneven = filler.join([*voyages, "Brenna Holt met Osterley's council."]) + filler
    assert (
        gather([uneven], "What did Brenna Holt do at Osterley and at Fennick?", 2048, 256, recurring=reads(True))[0] == "lookup"
    )
    assert asked == [False]  # the uneven question's plain read (its names left out); no strict read anywhere


def test_a_pronoun_opening_a_sentence_is_no_hop_and_a_scan_is_bounded():
    filler = "She walked along the shore and said nothing. " * 20
    documents = [filler + "She was the daughter of Corra Dene, said Ilsa Varn. " + filler + "By trade Corra Dene was a tanner."]
    strategy, sentences = gather(documents, "What was the trade of Ilsa Varn's mother?", 2048, 256)
    texts = [documents[0][s.start : s.end] for s in sentences]
    assert strategy == "lookup" and texts[-1] == "By trade Corra Dene was a tanner." and len(texts) == 2
    assert len(mentions(documents, ["She"], limit=3)) == 4  # stops one past the limit


def test_a_best_sentence_longer_than_the_budget_gathers_nothing():
    documents = ["Aldous K. Ashdown of Mill Row " + "and so on " * 300 + "left a bell."]
    assert gather(documents, "What did Aldous K. Ashdown of Mill Row leave?", 2048, 64) == ("none", [])


def test_ordinary_words_a_question_opens_with_are_no_names():
    common = common_words(["according to the letters, under the old rules, the associate director wrote."])
    assert question_names("According to Lesk, which magazine tried to buy the rights?", common) == ["Lesk"]
    assert question_names("Under the entry Dullard, where is their centre?", common) == ["Dullard"]
    assert question_names("Touchstone recalls breaking his sword.", common) == ["Touchstone"]
    assert question_names("According to Lesk, which magazine?") == ["According", "Lesk"]  # without the documents' words


def test_a_hop_follows_names_not_phrases_of_ordinary_words():
    filler = "Nothing happened; the associate of the director kept the books. " * 20
    staff = "The Associate Director signed the ledger. " * 3
    documents = [
        filler
        + "Ilsa Varn, Associate Director, was the daughter of Corra Dene. "
        + staff
        + filler
        + "By trade Corra Dene was a tanner."
    ]
    strategy, sentences = gather(documents, "What was the trade of Ilsa Varn's mother?", 2048, 256)
    texts = [documents[0][s.start : s.end] for s in sentences]
    assert strategy == "lookup" and texts == [
        "Ilsa Varn, Associate Director, was the daughter of Corra Dene.",
        "By trade Corra Dene was a tanner.",
    ]


def test_a_question_whose_words_point_at_one_passage_is_answered_as_a_local_one(tiny_tokenizer, embedder):
    from engine.memories import MemoryContext
    from tests.engine.test_memories import ingest, text_memory

    filler = "The weather was mild and nothing of note happened in the town that week. " * 40
    dockings = [f"In spring year {i} the Veridian docked at Carrow with salt." for i in range(5)]
    storm = "When the great storm broke, the crew of the Veridian counted seven shattered masts in the harbour."
    text = filler + " ".join(f"{docking} {filler}" for docking in dockings) + storm + " " + filler
    memory = text_memory(MemoryContext(tokenizer=tiny_tokenizer, embedder=embedder), {"gather": True, "margin": 2.0})
    ingest(memory, tiny_tokenizer, "record", text)
    local = memory.retrieve("How many shattered masts did the crew of the Veridian count when the great storm broke?", 4096)
    assert not any(p.item.gathered for p in local) and any(storm in p.text for p in local)  # the ranked chunk alone
    whole = memory.retrieve("How many times did the Veridian dock at Carrow?", 4096)
    assert sum(p.item.gathered == "whole" for p in whole) >= 1  # many passages score alike: every mention gathered
