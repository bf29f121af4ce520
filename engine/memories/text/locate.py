"""Questions about a place in a document: a named chapter (book, part, canto, act, or a scene of an
act: "In Chapter III", "How does Book X end?", "Act III, Scene 3") or its ending ("How does the story
end?", "the last thing Alice says").

`places` finds where such a question points, by the documents' sections (engine/documents/: a
PDF's bookmarks, an EPUB's or web page's headings, plain text's chapter headings). The `text`
memory with `locate` then ranks only the chunks inside that place, and for an ending hands the
reader the place's last `tail_tokens` too, marked `gathered: "tail"`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from engine.interface import Layout, Section

KINDS = "chapter|book|part|canto|act|scene"
REFERENCE = re.compile(rf"\b({KINDS})\s+([ivxlcdm]+|\d+)\b", re.IGNORECASE)
TITLE = re.compile(rf"^\s*({KINDS})\s+([ivxlcdm]+|\d+)\b", re.IGNORECASE)
HOLDS = {"book": {"part", "chapter", "canto"}, "part": {"chapter"}, "act": {"scene"}}  # what a kind's sections hold
LAST = re.compile(rf"\b(?:last|final)\s+({KINDS})\b", re.IGNORECASE)
ROMAN = re.compile(r"^m{0,4}(cm|cd|d?c{0,3})(xc|xl|l?x{0,3})(ix|iv|v?i{0,3})$")
ROMAN_VALUES = {"i": 1, "v": 5, "x": 10, "l": 50, "c": 100, "d": 500, "m": 1000}
ENDING = re.compile(
    r"\bhow does\b[^?.]{0,60}\bend\b|\bhow did\b[^?.]{0,60}\bend\b|\bend(?:ing)? of (?:the )?(?:book|story|novel|tale|poem)\b"
    r"|\bhow (?:it|the \w+) ends\b|\blast (?:chapter|book|part|scene|words|thing|lines)\b|\bfinal (?:chapter|scene|words|lines)\b",
    re.IGNORECASE,
)


def number(token: str) -> int | None:
    """An arabic or roman number ("27", "XII"), or None."""
    if token.isdigit():
        return int(token)
    roman = token.lower()
    if not roman or not ROMAN.match(roman):
        return None
    values = [ROMAN_VALUES[c] for c in roman]
    return sum(-v if i + 1 < len(values) and v < values[i + 1] else v for i, v in enumerate(values))


def _key(kind: str, token: str) -> tuple[str, int] | None:
    value = number(token)
    return (kind.lower(), value) if value is not None else None


@dataclass(frozen=True)
class Place:
    document: int  # its number among the memory's documents
    start: int
    end: int
    ending: bool  # the question asks how it ends


# words of a question that asks about a place as a whole ("What happens in Act III, Scene 3?",
# "Summarize the last chapter."), beside the place's own name
GENERAL = frozenset(
    "what whats what's happens happen happened happening occurs occur occurred goes go on take takes place in during at "
    "the of a an me us about give tell describe summarize summarise summary retell recount briefly brief main key events "
    "event plot is are was were there and please overall outline".split()
)


def is_ending(question: str) -> bool:
    return bool(ENDING.search(question))


def asks_whole(question: str) -> bool:
    """Whether a question names nothing but its place and general words: it asks what happens there
    as a whole, so no part of the place answers it better than another."""
    words = re.findall(r"[a-z']+", LAST.sub(" ", REFERENCE.sub(" ", question.lower())))
    return all(word in GENERAL for word in words)


def unplaced(question: str) -> str:
    """The question without the place it names ("In Act II, Scene 7, what does Jaques say?": "In ,
    , what does Jaques say?"), to rank the place's chunks by: every chunk there lies in that place,
    and its words would only favour the chunk holding the heading."""
    rest = LAST.sub(" ", REFERENCE.sub(" ", question))
    return rest if rest.strip(" ,.?!;:") else question


def places(
    question: str, documents: list[tuple[str, str]], layouts: Mapping[str, Layout], allowed: frozenset[str] | None
) -> list[Place]:
    """Where the question points in `documents` ((id, text) each): the sections it names by number
    and the last section of a kind it names as the last or final one ("the final scene"); for an
    ending question naming none, each document whole; [] when it points nowhere. A section inside
    another (`_enclosers`) of a kind the question names with another number is not taken, and a
    section holding one taken stands aside ("Act III, Scene 3": the scene, not the act)."""
    ending = is_ending(question)
    named = {key for kind, token in REFERENCE.findall(question) if (key := _key(kind, token))}
    lasts = [kind.lower() for kind in LAST.findall(question)]
    found: list[Place] = []
    for n, (document_id, text) in enumerate(documents):
        if allowed is not None and document_id not in allowed:
            continue
        layout = layouts.get(document_id)
        sections = layout.sections if layout else ()
        spans = _named_spans(sections, named, len(text))
        spans += [span for kind in lasts if (span := _last_of(sections, kind, len(text))) and span not in spans]
        if spans:
            found += [Place(n, start, end, ending) for start, end in spans]
        elif ending and not named:
            found.append(Place(n, 0, len(text), True))
    return found


def _named_spans(sections: tuple[Section, ...], named: set[tuple[str, int]], length: int) -> list[tuple[int, int]]:
    """(start, end) of each section `named` takes (see `places`), in order; a section whose heading
    is printed again (a play's act before each scene) is one span over all of it."""
    if not named:  # most questions name no section: no title is read
        return []
    kinds = {kind for kind, _ in named}
    keys = [_section_key(section) for section in sections]
    matched = [i for i, key in enumerate(keys) if key in named]
    enclosers = {i: _enclosers(sections, keys, i, kinds) for i in matched}
    matched = [i for i in matched if all(_agrees(keys[j], named, kinds) for j in enclosers[i])]
    held = {keys[j] for i in matched for j in enclosers[i]}
    spans: list[tuple[int, int]] = []
    last: tuple[str, int] | None = None  # the key of the section the last span ends with
    for i in matched:
        if keys[i] in held:
            continue
        start, end = sections[i].start, _end(sections, i, length)
        if spans and last == keys[i] and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
        last = keys[i]
    return spans


def _agrees(key: tuple[str, int] | None, named: set[tuple[str, int]], kinds: set[str]) -> bool:
    """Whether a section with `key` may hold a section the question names: it is named too, or of
    a kind the question gives no number for."""
    return key is None or key in named or key[0] not in kinds


def _enclosers(sections: tuple[Section, ...], keys: list[tuple[str, int] | None], i: int, kinds: set[str]) -> list[int]:
    """The sections section i lies in: each one before it of a lower level than the last found, and
    the nearest one before it of each kind in `kinds` that holds i's kind (`HOLDS`) whatever its
    level (a flat outline: an act's scenes at the act's level, a book's chapters at the book's)."""
    mine = keys[i]
    own = mine[0] if mine is not None else None
    out: list[int] = []
    level, seen = sections[i].level, set()
    for j in range(i - 1, -1, -1):
        key = keys[j]
        if sections[j].level < level:
            level = sections[j].level
            out.append(j)
        elif key is not None and key[0] in kinds and key[0] not in seen and own in HOLDS.get(key[0], ()):
            out.append(j)
        if key is not None:
            seen.add(key[0])
    return out


def _end(sections: tuple[Section, ...], i: int, length: int) -> int:
    """Where section i ends: at the next section of its level or above, else the text's end."""
    return next((s.start for s in sections[i + 1 :] if s.level <= sections[i].level), length)


def _last_of(sections: tuple[Section, ...], kind: str, length: int) -> tuple[int, int] | None:
    """(start, end) of the last section of `kind` (a numbered title), from the first of the
    headings printed again for it just before; None where there is none."""
    for i in range(len(sections) - 1, -1, -1):
        if (key := _section_key(sections[i])) is not None and key[0] == kind:
            start, level = sections[i].start, sections[i].level
            for outer in reversed(sections[:i]):  # its heading printed again before each of its scenes: all of it
                if outer.level <= level:
                    if _section_key(outer) != key:
                        break
                    start = outer.start
            return start, _end(sections, i, length)
    return None


def _section_key(section: Section) -> tuple[str, int] | None:
    title = TITLE.match(section.title)
    return _key(*title.groups()) if title else None
