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
taken (exact-match awareness: among look-alikes, the one with the initial and street the question
gives, and of those holding every name, the ones holding the words it sets beside them, such as a
trade: `closest`), and the names they add are followed one hop (two-hop questions: a person's
mother, then her trade). With `recurring` (the option `gather_recurring`), a
question is also a whole-document one where its names recur more than a lookup takes, or stand in
several sentences none of which holds most of them, and its form reads as one (question_form.py),
whatever its words; and where its names stand in two to LOOKUP_SENTENCES sentences that all match
it alike ("Tell me the towns the envoy X visited": every sentence naming X), when its form reads
clearly as one (`strict`: a lookup would hand over those sentences too, with one hop and ranked
chunks beside them, so only a clear form takes those away).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from bm25s.stopwords import STOPWORDS_EN

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
HOP_SENTENCES = 8  # names in more sentences than this are used often: nothing is gathered for them
MAX_NAMES = 16  # a question's names scanned for, at most (the longest first)
MAX_HOP_CHARS = 2_000  # of a best sentence, the characters read for the names a hop follows
MIN_SENTENCE_CHARS = 16  # a whole-document scan stops past budget / this many sentences
MAX_BESIDE_WORDS = 16  # of the words a question sets beside its names, at most this many weighed
_STOPWORDS = frozenset(STOPWORDS_EN)
_LOWER_WORD = re.compile(r"(?<![\w'])[a-z]{3,}(?!\w)")  # three letters or more; "tanner's" gives "tanner"


def question_names(question: str, common: Callable[[str], bool] = lambda word: False) -> list[str]:
    """The names a question gives: capitalised phrases, question words and a leading article left
    out, possessive "'s" dropped; the longest first. `common(word)`: the word is an ordinary one
    (the documents use it in lower case): such words are left out where only the sentence's start
    capitalised them ("According to Lesk" gives "Lesk"), and a name of one such word is no name."""
    names: set[str] = set()
    for match in _NAME.finditer(question):
        words = match.group(0).removesuffix("'s").split()
        while words and words[0] in _QUESTION_WORDS:
            words = words[1:]
        if words and opens_sentence(question, match.start()) and common(words[0]):
            words = words[1:]
        if words and not (len(words) == 1 and (len(words[0]) < 3 or common(words[0]))):
            names.add(" ".join(words))
    return sorted(names, key=lambda name: (-len(name), name))


def opens_sentence(text: str, at: int) -> bool:
    """Whether `at` opens a sentence of `text`: nothing but space and quotes since the last . ! ? or the start."""
    before = text[:at].rstrip(" \t\n\"'([")
    return not before or before[-1] in ".!?:;"


def common_words(documents: list[str]) -> Callable[[str], bool]:
    """`common(word)`: some document uses `word` in lower case (asked once a word, remembered)."""
    seen: dict[str, bool] = {}

    def common(word: str) -> bool:
        if word not in seen:
            pattern = re.compile(rf"(?<![\w-]){re.escape(word.lower())}(?![\w-])")
            seen[word] = any(pattern.search(text) for text in documents)
        return seen[word]

    return common


def is_whole_document(question: str) -> bool:
    """Whether the question asks about the whole document: counts, lists, first/last, comparisons, order."""
    return WHOLE_DOCUMENT.search(question) is not None


@dataclass(frozen=True)
class Sentence:
    document: int
    start: int
    end: int
    names: frozenset[str]  # the question's (or a hop's) names it holds


def _sentence_spans(text: str) -> Iterator[tuple[int, int]]:
    """(start, end) of each sentence of `text`, one at a time (no list of a whole book's sentences)."""
    start = 0
    for match in _SENTENCE_END.finditer(text):
        if text[start : match.start()].strip():
            yield start, match.start()
        start = match.end()
    if text[start:].strip():
        yield start, len(text)


def name_pattern(names: list[str]) -> re.Pattern[str]:
    """Any of `names`, whole, its words apart by any space."""
    alternatives = "|".join(r"\s+".join(re.escape(word) for word in name.split()) for name in names)
    return re.compile(rf"(?<![\w.])(?:{alternatives})(?!\w)")


def mentions(documents: list[str], names: list[str], limit: int | None = None) -> list[Sentence]:
    """The sentences of `documents` holding one of `names` exactly, in document order: all of them,
    or the first `limit` + 1 (one more than `limit` says there are more)."""
    if not names:
        return []
    pattern, found = name_pattern(names[:MAX_NAMES]), []
    for number, text in enumerate(documents):
        hits = pattern.finditer(text)
        hit = next(hits, None)
        if hit is None:
            continue
        for start, end in _sentence_spans(text):
            held = set()
            while hit is not None and hit.start() < end:
                if hit.start() >= start:
                    held.add(" ".join(hit.group(0).split()))
                hit = next(hits, None)
            if held:
                found.append(Sentence(number, start, end, frozenset(held)))
                if limit is not None and len(found) > limit:
                    return found
            if hit is None:
                break
    return found


def _within(sentences: list[Sentence], budget_chars: int, priority: Callable[[Sentence], tuple]) -> list[Sentence]:
    """The sentences that fit `budget_chars`, taken by `priority` (smallest first), in document order."""
    kept, left = [], budget_chars
    for sentence in sorted(sentences, key=priority):
        if sentence.end - sentence.start <= left:
            kept.append(sentence)
            left -= sentence.end - sentence.start
    return sorted(kept, key=lambda s: (s.document, s.start))


def _hop_names(documents: list[str], best: list[Sentence], given: list[str], common: Callable[[str], bool]) -> list[str]:
    """The names the best sentences add to the question's, but not a capitalised word that opens
    its sentence ("She", "Later"), nor one of ordinary words only ("Associate Director"), nor one the
    documents use often."""
    found: set[str] = set()
    for s in best:
        held = documents[s.document][s.start : min(s.end, s.start + MAX_HOP_CHARS)]
        for name in question_names(held, common):
            if all(common(word) for word in name.split()):
                continue
            if " " not in name and held.lstrip().startswith(name):
                continue
            found.add(name)
    rare = [
        name
        for name in sorted(found - set(given))[:MAX_NAMES]
        if len(mentions(documents, [name], HOP_SENTENCES)) <= HOP_SENTENCES
    ]
    return rare


def gather(
    documents: list[str],
    question: str,
    whole_tokens: int,
    lookup_tokens: int,
    recurring: Callable[[str, list[str], bool], bool] | None = None,
) -> tuple[str, list[Sentence]]:
    """(strategy, sentences in document order): "whole" (every mention of the question's names,
    within `whole_tokens`); "exact" (a sentence holds every name the question gives: the sentences
    that do, and one hop from them, within `lookup_tokens`; nothing else is needed); "lookup" (the
    sentences naming most of the question, and one hop, within `lookup_tokens`, before the ranked
    chunks); or "none" (nothing to gather: the ranked chunks answer alone). A question is a
    whole-document one by its words (`is_whole_document`), or where its names stand in more
    sentences than a lookup takes (more than HOP_SENTENCES, or more than LOOKUP_SENTENCES that
    match it equally well) or the best of them leave some of its names out, and `recurring(question,
    names, False)` says it is one (its form: question_form.py; None: never): then every mention, when
    they fit. Likewise where two to LOOKUP_SENTENCES sentences name the question's names, all
    alike, the question is no `exact` one, and `recurring(question, names, True)` says so (strict:
    its form reads clearly as one), when they fit; else the lookup, as without it. What a question
    scans is bounded: at most MAX_NAMES names, and a scan stops once it has more sentences than it
    can use."""
    common = common_words(documents)
    names = question_names(question, common)[:MAX_NAMES]
    if is_whole_document(question):
        return _every_mention(documents, names, whole_tokens)
    first = mentions(documents, names, HOP_SENTENCES)
    if not first:
        return "none", []  # nothing named

    def whole(strict: bool = False) -> bool:
        return recurring is not None and recurring(question, names, strict)

    if len(first) > HOP_SENTENCES:  # names the document repeats; a book's main characters do not fit
        return _every_mention(documents, names, whole_tokens) if whole() else ("none", [])
    weight = {(s.document, s.start): sum(len(name) for name in s.names) for s in first}
    top = max(weight.values())
    best = [s for s in first if weight[(s.document, s.start)] == top]  # the fullest match of the question
    # below, `first` already holds every mention (no more than HOP_SENTENCES): no second scan
    if len(best) > LOOKUP_SENTENCES:
        return _whole_if_fits(first, whole_tokens) if whole() else ("none", [])
    if not frozenset().union(*(s.names for s in first)) <= frozenset().union(*(s.names for s in best)) and whole():
        return _whole_if_fits(first, whole_tokens)  # its names in several sentences, none holding most
    # every name the question gives, in one sentence, and more than one name or a name with an
    # initial: the question picks one of look-alikes, and ranked chunks would bring the others back
    exact = top == sum(len(name) for name in names) and (len(names) > 1 or re.search(r"\b[A-Z]\.", names[0]) is not None)
    if not exact and 2 <= len(best) == len(first) and whole(strict=True):  # every mention, all alike
        every = _whole_if_fits(first, whole_tokens)
        if every[0] == "whole":
            return every
    alike = {(s.document, s.start) for s in best}  # a look-alike left out below does not come back as a hop
    if exact:
        best = closest(documents, best, question, names)
    taken = {(s.document, s.start) for s in best}
    hop = [s for s in mentions(documents, _hop_names(documents, best, names, common)) if (s.document, s.start) not in alike]
    kept = _within(
        best + hop[:HOP_SENTENCES],
        lookup_tokens * _CHARS_PER_TOKEN,
        lambda s: ((s.document, s.start) not in taken, s.document, s.start),
    )
    if not {(s.document, s.start) for s in kept} & taken:
        return "none", []  # the best sentences do not fit the budget: the ranked chunks answer
    return "exact" if exact else "lookup", kept


def closest(documents: list[str], best: list[Sentence], question: str, names: list[str]) -> list[Sentence]:
    """Of look-alike sentences that hold every name a question gives, those that also hold most of
    the lower-case words it sets beside its names ("the tanner X of Y", "X (tanner, Y)": not the
    cooper of the same name and street). Only the words some of them lack tell them apart; each
    weighs by how rarely the documents use it (1 / its count there). Every sentence holding at
    least half the weight of the best one is kept, so a near tie keeps both, and all of them where
    no such word is found."""
    if len(best) < 2:
        return best
    texts = [documents[s.document][s.start : s.end] for s in best]
    words = sorted(set(_LOWER_WORD.findall(beside_names(question, names))) - _STOPWORDS)[:MAX_BESIDE_WORDS]
    weights = []
    for word in words:
        pattern = re.compile(rf"(?<!\w){word}(?!\w)")  # lower-case letters only: nothing to escape
        holding = sum(1 for text in texts if pattern.search(text))
        if 0 < holding < len(texts):  # a word every look-alike holds tells none apart
            weights.append((pattern, 1.0 / sum(len(pattern.findall(document)) for document in documents)))
    held = [sum(weight for pattern, weight in weights if pattern.search(text)) for text in texts]
    return [s for s, weight_held in zip(best, held, strict=True) if 2 * weight_held >= max(held)]


def beside_names(question: str, names: list[str]) -> str:
    """The part of `question` from two words before its first name to the end of its last: where it
    says what its names are ("the tanner X of Y"), not what it asks of them ("... left what?")."""
    found = list(name_pattern(names).finditer(question)) if names else []
    if not found:
        return ""
    before = question[: found[0].start()].split()
    return " ".join(before[-2:]) + " " + question[found[0].start() : found[-1].end()]


def _every_mention(documents: list[str], names: list[str], whole_tokens: int) -> tuple[str, list[Sentence]]:
    """("whole", every sentence naming one of `names`) when they fit `whole_tokens`; else ("none", [])."""
    return _whole_if_fits(mentions(documents, names, whole_tokens * _CHARS_PER_TOKEN // MIN_SENTENCE_CHARS), whole_tokens)


def _whole_if_fits(found: list[Sentence], whole_tokens: int) -> tuple[str, list[Sentence]]:
    """("whole", `found`: every mention, or one past a scan's limit) when they fit `whole_tokens`; else ("none", [])."""
    budget = whole_tokens * _CHARS_PER_TOKEN
    if not found or len(found) > budget // MIN_SENTENCE_CHARS or sum(s.end - s.start for s in found) > budget:
        return "none", []  # not every mention fits: no exhaustive answer to give, the ranked chunks answer
    return "whole", found


def merged(gathered: list[ContextPiece], ranked: list[ContextPiece], documents: list[tuple[str, str]]) -> list[ContextPiece]:
    """Gathered sentences and ranked excerpts in document order (`documents`: (id, text) each); a
    sentence that overlaps a ranked excerpt widens that excerpt to cover it instead, so no text is
    handed over twice; the widened excerpt keeps its score and takes the gathered one's mark."""
    order = {document_id: number for number, (document_id, _) in enumerate(documents)}
    texts = dict(documents)
    pieces = sorted([*gathered, *ranked], key=lambda piece: (order[piece.item.document_id], piece.item.char_start))
    out: list[ContextPiece] = []
    for piece in pieces:
        last = out[-1] if out else None
        if last is not None and last.item.document_id == piece.item.document_id and piece.item.char_start < last.item.char_end:
            if last.item.gathered is not None and piece.item.gathered is None:
                last, piece = piece, last  # the ranked excerpt keeps its own fields
            start, end = min(last.item.char_start, piece.item.char_start), max(last.item.char_end, piece.item.char_end)
            item = replace(last.item, char_start=start, char_end=end, gathered=last.item.gathered or piece.item.gathered)
            out[-1] = ContextPiece(texts[item.document_id][start:end], item)
            continue
        out.append(piece)
    return out
