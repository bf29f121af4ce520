"""Questions about a place: named chapters and endings (engine/memories/text/locate.py, `locate`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.documents.parsers import plain_text
from engine.interface import Layout, Section
from engine.memories import MemoryContext, Scope
from engine.memories.text.locate import asks_whole, is_ending, number, places, unplaced
from engine.memories.text.memory import TextMemory
from engine.memories.text.options import TextOptions
from tests.engine.test_memories import ingest, text_memory
from tests.helpers import FIXTURES

ALICE = (FIXTURES / "alice29.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def alice_memory(tiny_tokenizer, embedder) -> TextMemory:
    """Alice ingested once for the module's retrieval tests; each sets the options it reads with (`_with`)."""
    memory = text_memory(MemoryContext(tokenizer=tiny_tokenizer, embedder=embedder), {"locate": True})
    ingest(memory, tiny_tokenizer, "a", ALICE)
    return memory


def _with(memory: TextMemory, **options) -> TextMemory:
    """`memory` reading with `locate` and these options (none change what ingestion stored)."""
    memory.options = replace(TextOptions(locate=True), **options)
    return memory


def test_numbers_arabic_and_roman():
    assert [number(t) for t in ("27", "XII", "iv", "MCMXC", "dim", "IIII", "")] == [27, 12, 4, 1990, None, None, None]


def test_plain_text_chapters_and_verses():
    sections = plain_text(ALICE).layout.sections
    assert [s.title for s in sections][:3] == ["CHAPTER I", "CHAPTER II", "CHAPTER III"] and len(sections) == 12
    assert all(ALICE[s.start :].startswith(s.title) for s in sections)
    verses = "1:1 In the beginning.\n1:2 And then.\n2:1 Later on.\n2:2 The end.\n"
    assert [(s.title, s.start) for s in plain_text(verses).layout.sections] == [
        ("Chapter 1", 0),
        ("Chapter 2", verses.index("2:1")),
    ]
    assert plain_text("We read Chapter IV of it yesterday.\n").layout.sections == ()  # a mention, not a heading
    crlf = ALICE.replace("\n", "\r\n")  # as a Windows file is sent
    assert [s.title for s in plain_text(crlf).layout.sections] == [s.title for s in sections]


def test_questions_point_at_named_sections_or_the_ending():
    layout = plain_text(ALICE).layout
    documents, layouts = [("a", ALICE)], {"a": layout}
    (third,) = places("In Chapter III, how do the creatures get dry?", documents, layouts, None)
    assert ALICE[third.start :].startswith("CHAPTER III") and ALICE[third.end :].startswith("CHAPTER IV") and not third.ending
    (eighth,) = places("How does Chapter VIII end?", documents, layouts, None)
    assert eighth.ending and ALICE[eighth.end :].startswith("CHAPTER IX")
    (last,) = places("Summarize the last chapter.", documents, layouts, None)
    assert last.ending and ALICE[last.start :].startswith("CHAPTER XII") and last.end == len(ALICE)
    assert places("Summarize the last chapter.", [("a", "No chapters here.")], {}, None)[0].end == len("No chapters here.")
    (whole,) = places("How does the story end?", documents, layouts, None)
    assert (whole.start, whole.end, whole.ending) == (0, len(ALICE), True)
    assert places("Who is the Cheshire Cat?", documents, layouts, None) == []
    assert places("How does the story end?", documents, layouts, frozenset({"b"})) == []
    assert places("In Chapter XL what happens?", documents, layouts, None) == []  # no such chapter
    assert is_ending("What is the last thing Alice says to the court?") and not is_ending("Where does the road end up?")


PLAY = "".join(
    f"\n\nACT {act}\n\n\nSCENE {scene}\tA place.\n\nFIRST LORD\tThis is act {act}, scene {scene}.\n"
    for act, scenes in (("I", ("I", "II", "III")), ("II", ("I", "II")))
    for scene in scenes
)  # as the Shakespeare texts print it: the act's heading again before each of its scenes


def test_a_plays_scenes_lie_inside_its_acts():
    sections = plain_text(PLAY).layout.sections
    assert [(s.level, s.title) for s in sections][:4] == [
        (1, "ACT I"),
        (2, "SCENE I A place."),
        (1, "ACT I"),
        (2, "SCENE II A place."),
    ]
    documents, layouts = [("p", PLAY)], {"p": plain_text(PLAY).layout}

    def read(question: str) -> list[str]:
        return [" ".join(PLAY[p.start : p.end].split()) for p in places(question, documents, layouts, None)]

    assert read("What happens in Act II, Scene I?") == ["SCENE I A place. FIRST LORD This is act II, scene I."]
    assert read("In scene 2 of act 1, who speaks?") == ["SCENE II A place. FIRST LORD This is act I, scene II."]
    (act,) = read("What happens in Act II?")  # one place under the repeated headings
    assert act.startswith("ACT II SCENE I") and act.endswith("act II, scene II.") and "act I," not in act
    (ending,) = places("How does Act I end?", documents, layouts, None)
    assert ending.ending and PLAY[ending.end :].lstrip().startswith("ACT II")
    assert len(read("What happens in Scene II?")) == 2  # no act named: the scene of that number in each act
    assert read("What happens in Act III, Scene I?") == []
    assert len(read("How do Act I and Act II end?")) == 2  # two acts side by side stay two places, a tail each
    assert read("How many people speak in the final scene?") == ["SCENE II A place. FIRST LORD This is act II, scene II."]
    assert places("How many people speak in the final scene?", documents, layouts, None)[0].ending
    (last_act,) = read("What happens in the last act?")
    assert "act II, scene I." in last_act and last_act.endswith("act II, scene II.") and "act I," not in last_act


def outline(*titles: tuple[int, str]) -> tuple[str, dict[str, Layout]]:
    """A document of one line a section, its sections at the levels given (as bookmarks give them)."""
    text, sections = "", []
    for level, title in titles:
        sections.append(Section(len(text), level, title))
        text += f"{title}. Some text of {title}.\n"
    return text, {"d": Layout("pdf", (), tuple(sections))}


def test_sections_inside_others_in_nested_and_flat_outlines():
    def read(question: str, text: str, layouts: dict[str, Layout]) -> list[str]:
        return [text[p.start : p.end].split(".")[0] for p in places(question, [("d", text)], layouts, None)]

    nested = outline((1, "Chapter 1"), (1, "Chapter 2"), (1, "Solutions"), (2, "Chapter 2 solutions"))
    assert read("How does Chapter 2 end?", *nested) == ["Chapter 2", "Chapter 2 solutions"]  # neither holds the other
    flat = outline((1, "Act I"), (1, "Scene 1"), (1, "Scene 2"), (1, "Act II"), (1, "Scene 1"), (1, "Scene 2"))
    (scene,) = places("What happens in Act II, Scene 2?", [("d", flat[0])], flat[1], None)
    assert scene.start == flat[1]["d"].sections[-1].start  # Act II's, not Act I's
    books = outline((1, "Book I"), (1, "Chapter I"), (1, "Chapter III"), (1, "Book II"), (1, "Chapter I"), (1, "Chapter III"))
    (third,) = places("In Book II, Chapter 3, who leaves?", [("d", books[0])], books[1], None)
    assert third.start == books[1]["d"].sections[-1].start
    (first, last) = places("Compare Chapter I with the last chapter.", [("a", ALICE)], {"a": plain_text(ALICE).layout}, None)
    assert ALICE[first.start :].startswith("CHAPTER I\n") and ALICE[last.start :].startswith("CHAPTER XII")


def test_a_located_question_reads_its_place_and_an_ending_its_tail(alice_memory):
    memory = _with(alice_memory)
    scope = Scope(None, {"a": plain_text(ALICE).layout})
    start, end = ALICE.index("CHAPTER VIII"), ALICE.index("CHAPTER IX")
    pieces = memory.retrieve("How does Chapter VIII end? What are the King and the Queen doing?", 1500, scope)
    assert pieces and all(start <= p.item.char_start and p.item.char_end <= end for p in pieces)  # cut to the chapter
    assert all(p.text == ALICE[p.item.char_start : p.item.char_end] for p in pieces)
    assert {p.item.gathered for p in pieces} == {"tail", "located"}  # the ranked chunks marked as found in the place
    tail = [p for p in pieces if p.item.gathered == "tail"]
    assert len(tail) == 1 and tail[0].item.char_start < end and not ALICE[tail[0].item.char_end : end].strip()
    ending = memory.retrieve("How does the book end?", 1500, scope)
    assert ending[-1].item.char_end == len(ALICE) and ending[-1].item.gathered == "tail"
    plain = memory.retrieve("Who is the Cheshire Cat?", 1500, scope)
    assert plain == memory.retrieve("Who is the Cheshire Cat?", 1500) and not any(p.item.gathered for p in plain)


def test_a_question_about_a_whole_place_reads_all_of_it_spread_out(alice_memory):
    assert asks_whole("What happens in Act III, Scene 3?") and asks_whole("Summarize the last chapter.")
    assert not asks_whole("In Chapter III, how do the creatures get dry?") and not asks_whole("How does Chapter VIII end?")
    scope = Scope(None, {"a": plain_text(ALICE).layout})
    start, end = ALICE.index("CHAPTER VII"), ALICE.index("CHAPTER VIII")
    memory = _with(alice_memory, margin=2.0, context_tokens=768)
    pieces = memory.retrieve("What happens in Chapter VII?", 1500, scope)
    spans = [(p.item.char_start, p.item.char_end) for p in pieces]
    assert len(pieces) > 4 and spans == sorted(spans) and all(start <= a and b <= end for a, b in spans)
    assert spans[0][0] - start < 200 and end - spans[-1][1] < 1000  # from its start to its end, with gaps between
    assert sum(memory.excerpts.token_count(p.text) for p in pieces) <= 768
    memory.options = replace(memory.options, context_tokens=8192)  # a budget the chapter fits in
    pieces = memory.retrieve("What happens in Chapter VII?", 10_000, scope)
    assert len(pieces) == 1 and pieces[0].text == ALICE[start:end].strip()


def test_a_place_is_ranked_without_its_own_name(alice_memory):
    assert unplaced("In Act II, Scene 7, what does Jaques say?") == "In  ,  , what does Jaques say?"
    assert unplaced("Chapter 3?") == "Chapter 3?"  # nothing else to rank by
    memory = _with(alice_memory, margin=2.0)
    scope = Scope(None, {"a": plain_text(ALICE).layout})
    for question, heading in (
        ("What does the Duchess throw in Chapter VI?", "CHAPTER VI"),
        ("What riddle does the Hatter ask in Chapter VII?", "CHAPTER VII"),
    ):
        start = ALICE.index(heading)
        pieces = memory.retrieve(question, 1500, scope)
        # the chunk holding the chapter's heading matched the chapter's name best and came back as
        # the heading and a line (alone, for the Duchess: it stood out by more than the margin)
        assert len(pieces) >= 3 and all(p.item.char_start > ALICE.index("\n\n\n", start) for p in pieces)
