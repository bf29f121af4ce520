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


def is_ending(question: str) -> bool:
    return bool(ENDING.search(question))


def places(
    question: str, documents: list[tuple[str, str]], layouts: Mapping[str, Layout], allowed: frozenset[str] | None
) -> list[Place]:
    """Where the question points in `documents` ((id, text) each): the named sections found, or for
    an ending question naming none, each document whole ("the last chapter", "the final scene": the
    last section of that kind where there are such); [] when it points nowhere. A section inside
    another (a scene in its act) is found only where the question names no other number of the
    outer one's kind, and the innermost ones found stand for the place ("Act III, Scene 3": the
    scene, not the act)."""
    ending = is_ending(question)
    named = {key for kind, token in REFERENCE.findall(question) if (key := _key(kind, token))}
    found = []
    for n, (document_id, text) in enumerate(documents):
        if allowed is not None and document_id not in allowed:
            continue
        layout = layouts.get(document_id)
        sections = layout.sections if layout else ()
        if not named:
            lasts = [span for kind in LAST.findall(question) if (span := _last_of(sections, kind.lower(), len(text)))]
            if lasts:  # "the last chapter", "in the final scene": the document's last section of that kind
                found += [Place(n, start, end, ending) for start, end in dict.fromkeys(lasts)]
            elif ending:
                found.append(Place(n, 0, len(text), True))
            continue
        matched = [i for i in range(len(sections)) if _named(sections, i, named)]
        deepest = max((sections[i].level for i in matched), default=0)
        last = None  # the section the place found last begins with
        for i in matched:
            if sections[i].level == deepest:
                end = next((s.start for s in sections[i + 1 :] if s.level <= sections[i].level), len(text))
                repeated = last is not None and _section_key(last) == _section_key(sections[i])
                if repeated and found[-1].document == n and found[-1].end == sections[i].start:  # one act, its heading repeated
                    found[-1] = Place(n, found[-1].start, end, ending)
                else:
                    found.append(Place(n, sections[i].start, end, ending))
                last = sections[i]
    return found


def _last_of(sections: tuple[Section, ...], kind: str, length: int) -> tuple[int, int] | None:
    """(start, end) of the last section of `kind` (a numbered title), or None where there is none."""
    for i in range(len(sections) - 1, -1, -1):
        if (key := _section_key(sections[i])) is not None and key[0] == kind:
            start, level = sections[i].start, sections[i].level
            end = next((s.start for s in sections[i + 1 :] if s.level <= level), length)
            for outer in reversed(sections[:i]):  # its heading printed again before each of its scenes: all of it
                if outer.level <= level:
                    if _section_key(outer) != key:
                        break
                    start = outer.start
            return start, end
    return None


def _section_key(section: Section) -> tuple[str, int] | None:
    title = TITLE.match(section.title)
    return _key(*title.groups()) if title else None


def _named(sections: tuple[Section, ...], i: int, named: set[tuple[str, int]]) -> bool:
    """Whether section i is named, and none of the sections it lies in is of a kind the question
    names with another number."""
    if _section_key(sections[i]) not in named:
        return False
    level, kinds = sections[i].level, {kind for kind, _ in named}
    for outer in reversed(sections[:i]):
        if outer.level < level:
            level = outer.level
            key = _section_key(outer)
            if key is not None and key[0] in kinds and key not in named:
                return False
    return True
