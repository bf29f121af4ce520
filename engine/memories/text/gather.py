"""Gathering from the whole document: every sentence that names what the question names.

Top-k chunks hand the reader a few passages; a question whose answer is spread over the document
(how many times, every, first or last, which more often, in what order) needs every passage that
mentions its names, in document order. And a question that names an exact combination (a middle
initial, a street, a trade) needs the sentence holding that combination, which a fused score of a
128-token chunk does not single out among look-alikes.

The question's names are its capitalised phrases (initials such as "K." included, question words
and a leading "The" left out). A sentence is taken when it holds one of them exactly (case and
word boundaries kept). For a whole-document question every such sentence is taken, in document
order, when all of them fit the budget (else nothing is gathered: an answer from some of the
mentions would be stated as if from all). Gathering serves names the document uses rarely; for
names it uses often (a book's main characters), the ranked chunks answer as without it. For any
other question, the sentences naming the most of the question (the longest names, summed) are
taken (exact-match awareness: among look-alikes, the one with the initial, trade and street the
question gives), and the names they add are followed one hop (two-hop questions: a person's
mother, then her trade).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from engine.memories.base import ContextPiece

WHOLE_DOCUMENT = re.compile(
    r"\b(how many|how often|count|every|all the|all of|name all|list|first|last|earliest|latest|"
    r"more often|more times|most often|fewest|them all|each|in what order|in which order|what order|which order|order)\b",
    re.IGNORECASE,
)
_NAME = re.compile(r"(?:[A-Z][\w'-]*[a-z][\w'-]*|[A-Z]\.)(?:\s+(?:[A-Z][\w'-]*[a-z][\w'-]*|[A-Z]\.))*")
_QUESTION_WORDS = frozenset(
    "What Which Who Whom Whose When Where Why How Did Does Do Is Was Were Are In Of On At To For By From The A An "
    "Name List Count Give Tell Describe Summarize Summarise Please And Or Between Among After Before".split()
)
# a sentence ends at . ! or ? and space, but not after an initial ("Aldous K. Ashdown"), or at a blank line
_SENTENCE_END = re.compile(r"(?<=[.!?])(?<!\b[A-Z]\.)[\"')\]]*\s+|\n\s*\n")
_CHARS_PER_TOKEN = 4
LOOKUP_SENTENCES = 4  # a local question's exact-match sentences, at most
HOP_SENTENCES = 8  # a second hop follows names only from this few first-hop sentences


def question_names(question: str) -> list[str]:
    """The names a question gives: capitalised phrases, question words and a leading article left
    out, possessive "'s" dropped; the longest first."""
    names: set[str] = set()
    for match in _NAME.finditer(question):
        words = match.group(0).removesuffix("'s").split()
        while words and words[0] in _QUESTION_WORDS:
            words = words[1:]
        if words and not (len(words) == 1 and len(words[0]) < 3):
            names.add(" ".join(words))
    return sorted(names, key=lambda name: (-len(name), name))


def is_whole_document(question: str) -> bool:
    """Whether the question asks about the whole document: counts, lists, first/last, comparisons, order."""
    return WHOLE_DOCUMENT.search(question) is not None


@dataclass(frozen=True)
class Sentence:
    document: int
    start: int
    end: int
    names: frozenset[str]  # the question's (or a hop's) names it holds


def _sentence_spans(text: str) -> list[tuple[int, int]]:
    spans, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        if text[start : match.start()].strip():
            spans.append((start, match.start()))
        start = match.end()
    if text[start:].strip():
        spans.append((start, len(text)))
    return spans


def _pattern(names: list[str]) -> re.Pattern[str]:
    alternatives = "|".join(r"\s+".join(re.escape(word) for word in name.split()) for name in names)
    return re.compile(rf"(?<![\w.])(?:{alternatives})(?!\w)")


def mentions(documents: list[str], names: list[str]) -> list[Sentence]:
    """Every sentence of `documents` holding one of `names` exactly, in document order."""
    if not names:
        return []
    pattern, found = _pattern(names), []
    for number, text in enumerate(documents):
        hits = [(m.start(), " ".join(m.group(0).split())) for m in pattern.finditer(text)]
        if not hits:
            continue
        spans, index = _sentence_spans(text), 0
        for start, end in spans:
            held = set()
            while index < len(hits) and hits[index][0] < end:
                if hits[index][0] >= start:
                    held.add(hits[index][1])
                index += 1
            if held:
                found.append(Sentence(number, start, end, frozenset(held)))
    return found


def _within(sentences: list[Sentence], budget_chars: int, priority: Callable[[Sentence], tuple]) -> list[Sentence]:
    """The sentences that fit `budget_chars`, taken by `priority` (smallest first), in document order."""
    kept, left = [], budget_chars
    for sentence in sorted(sentences, key=priority):
        if sentence.end - sentence.start <= left:
            kept.append(sentence)
            left -= sentence.end - sentence.start
    return sorted(kept, key=lambda s: (s.document, s.start))


def gather(documents: list[str], question: str, whole_tokens: int, lookup_tokens: int) -> tuple[str, list[Sentence]]:
    """(strategy, sentences in document order): "whole" (every mention of the question's names,
    within `whole_tokens`); "exact" (a sentence holds every name the question gives: the sentences
    that do, and one hop from them, within `lookup_tokens`; nothing else is needed); "lookup" (the
    sentences naming most of the question, and one hop, within `lookup_tokens`, before the ranked
    chunks); or "none" (the question names nothing the documents hold)."""
    names = question_names(question)
    first = mentions(documents, names)
    if not first:
        return "none", []
    if is_whole_document(question):
        if sum(s.end - s.start for s in first) > whole_tokens * _CHARS_PER_TOKEN:
            return "none", []  # not every mention fits: no exhaustive answer to give, the ranked chunks answer
        return "whole", first
    budget = lookup_tokens * _CHARS_PER_TOKEN
    weight = {(s.document, s.start): sum(len(name) for name in s.names) for s in first}
    top = max(weight.values())
    best = [s for s in first if weight[(s.document, s.start)] == top]  # the fullest match of the question
    if len(best) > LOOKUP_SENTENCES or len(first) > HOP_SENTENCES:
        return "none", []  # names the document uses often (a book's main characters): the ranked chunks answer
    taken = {(s.document, s.start) for s in best}
    hop_names = {name for s in best for name in question_names(documents[s.document][s.start : s.end])} - set(names)
    hop = [s for s in mentions(documents, sorted(hop_names)) if (s.document, s.start) not in taken][:HOP_SENTENCES]
    # every name the question gives, in one sentence, and more than one name or a name with an
    # initial: the question picks one of look-alikes, and ranked chunks would bring the others back
    exact = top == sum(len(name) for name in names) and (len(names) > 1 or re.search(r"\b[A-Z]\.", names[0]) is not None)
    return "exact" if exact else "lookup", _within(
        best + hop, budget, lambda s: ((s.document, s.start) not in {(b.document, b.start) for b in best}, s.document, s.start)
    )


def merged(gathered: list[ContextPiece], ranked: list[ContextPiece], order: list[str]) -> list[ContextPiece]:
    """Gathered sentences and ranked excerpts in document order (`order`: the documents' ids), a
    sentence that lies inside a ranked excerpt left out."""

    def inside(piece: ContextPiece) -> bool:
        item = piece.item
        return any(
            r.item.document_id == item.document_id and r.item.char_start <= item.char_start and item.char_end <= r.item.char_end
            for r in ranked
        )

    pieces = [piece for piece in gathered if not inside(piece)] + ranked
    return sorted(pieces, key=lambda piece: (order.index(piece.item.document_id), piece.item.char_start))
