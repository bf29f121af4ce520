"""Write a benchmark's section into a Markdown file of figures (docs/benchmarks.md and others):
the section of the same heading is replaced, with the date it was measured; the rest is kept."""

from __future__ import annotations

import datetime
from pathlib import Path


def replace_section(document: str, section: str) -> str:
    """`document` with its section of the same `## ` heading replaced by `section` (appended if absent);
    every other section is kept as it is."""
    heading = section.split("\n", 1)[0]
    start = document.find(heading + "\n")
    if start < 0:
        return document.rstrip("\n") + "\n\n" + section
    end = document.find("\n## ", start + len(heading))
    rest = document[end + 1 :] if end >= 0 else ""
    return document[:start] + section + ("\n" + rest if rest else "")


def dated(section: str, day: datetime.date) -> str:
    """The section with "Measured <day>." as its first line under the heading."""
    heading, _, body = section.partition("\n")
    body = body.lstrip("\n")
    return f"{heading}\n\nMeasured {day.isoformat()}.\n\n{body}"


def write_section(path: Path, section: str, *, title: str = "# Benchmarks") -> None:
    old = path.read_text() if path.exists() else title + "\n"
    path.write_text(replace_section(old, dated(section, datetime.date.today())))
