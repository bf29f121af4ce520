"""Write a benchmark's section into a Markdown file of figures (docs/benchmarks.md)."""

from __future__ import annotations

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


def write_section(path: Path, section: str) -> None:
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    path.write_text(replace_section(old, section))
