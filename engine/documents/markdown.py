"""Markdown: the text as written (so passages quote the source), its ATX (`# Title`) and setext
(`Title` over `===`) headings as sections; headings inside fenced code are not sections."""

from __future__ import annotations

import re

from engine.interface import Layout, ParsedDocument, Section

ATX = re.compile(r" {0,3}(#{1,6})[ \t]+(.*)$")  # its closing #s stripped after: no backtracking
SETEXT = re.compile(r" {0,3}(=+|-+)[ \t]*$")
FENCE = re.compile(r" {0,3}(```|~~~)")


def parse_markdown(text: str) -> ParsedDocument:
    sections: list[Section] = []
    offset = 0
    fenced = False
    previous: tuple[int, str] | None = None  # the last plain line: (offset, text), a setext title if underlined
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        if FENCE.match(body):
            fenced, previous = not fenced, None
        elif not fenced and (atx := ATX.match(body)) and (title := atx.group(2).rstrip(" \t#").strip()):
            sections.append(Section(offset + atx.start(2), len(atx.group(1)), title))
            previous = None
        elif not fenced and previous is not None and SETEXT.match(body):
            start, title = previous
            sections.append(Section(start, 1 if body.strip()[0] == "=" else 2, title.strip()))
            previous = None
        else:
            previous = (offset + len(body) - len(body.lstrip()), body) if body.strip() and not fenced else None
        offset += len(line)
    return ParsedDocument(text, Layout("markdown", (), tuple(sections)))
