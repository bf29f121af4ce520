"""Chapter headings of plain text: a short line of its own after a blank line that names a chapter,
book, part, canto or act with a number ("CHAPTER IV", "Book II", "Part 3: The Return"), and a play's
scenes below its acts ("SCENE III\tThe forest."); scripture without headings gets a chapter where
each chapter's first verse starts ("27:1 And when ...")."""

from __future__ import annotations

import re

from engine.interface import Section

HEADING = re.compile(
    r"(?:\A|\n[ \t]*\r?\n)[ \t]*((chapter|book|part|canto|act|scene)[ \t]+(?:[ivxlcdm]+|\d+)\b[^\r\n]{0,60}?)[ \t]*(?=\r?\n|\Z)",
    re.IGNORECASE,
)
BELOW = {"scene": 2}  # a scene lies inside the act before it; every other kind is a top section


def _level(kind: str) -> int:
    return BELOW.get(kind.lower(), 1)


FIRST_VERSE = re.compile(r"^(\d+):1[ \t]", re.MULTILINE)


def text_sections(text: str) -> tuple[Section, ...]:
    sections = [Section(m.start(1), _level(m.group(2)), " ".join(m.group(1).split())) for m in HEADING.finditer(text)]
    if not sections:
        sections = [Section(m.start(), 1, f"Chapter {m.group(1)}") for m in FIRST_VERSE.finditer(text)]
    return tuple(sections)
