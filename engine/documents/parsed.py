"""`TextBuilder` writes a parsed document's text, the character where each page starts and its
sections (headings) at once."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.interface import Layout, ParsedDocument, Section


@dataclass
class TextBuilder:
    """Appends paragraphs, headings and page breaks, keeping the offsets of pages and sections."""

    parts: list[str] = field(default_factory=list)
    size: int = 0
    pages: list[int] = field(default_factory=list)
    sections: list[Section] = field(default_factory=list)
    pending_pages: int = 0  # pages begun whose first character is not written yet

    def _append(self, text: str, separator: str = "\n\n") -> int:
        if self.size:
            self.parts.append(separator)
            self.size += len(separator)
        start = self.size
        self.pages.extend([start] * self.pending_pages)
        self.pending_pages = 0
        self.parts.append(text)
        self.size += len(text)
        return start

    def page(self) -> None:
        self.pending_pages += 1

    def heading(self, level: int, title: str) -> None:
        title = " ".join(title.split())
        if title:
            self.sections.append(Section(self._append(title), level, title))

    def paragraph(self, text: str, *, continues: bool = False) -> None:
        """A paragraph, or (`continues`) the rest of the last one, carried over a page break."""
        text = text.strip()
        if text:
            self._append(text, " " if continues and self.size else "\n\n")

    def build(self, format: str, title: str | None = None) -> ParsedDocument:
        text = "".join(self.parts)
        pages = (*self.pages, *[len(text)] * self.pending_pages)
        return ParsedDocument(text, Layout(format, pages, tuple(self.sections), title))
