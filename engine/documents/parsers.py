"""One parser per format, chosen from a table; `parse_in_process` runs one here."""

from __future__ import annotations

from collections.abc import Callable

from engine.config import ParseLimits
from engine.documents.detect import decode_text
from engine.documents.html import parse_html
from engine.documents.markdown import parse_markdown
from engine.documents.packages import parse_docx, parse_epub
from engine.documents.pdf import parse_pdf
from engine.documents.plaintext import text_sections
from engine.interface import Layout, ParsedDocument

Parser = Callable[[bytes, str | None, ParseLimits], ParsedDocument]

PARSERS: dict[str, Parser] = {
    "text": lambda data, charset, limits: plain_text(decode_text(data, charset)),
    "markdown": lambda data, charset, limits: parse_markdown(decode_text(data, charset)),
    "html": lambda data, charset, limits: parse_html(decode_text(data, charset, html=True)),
    "pdf": lambda data, charset, limits: parse_pdf(data, limits.max_pages),
    "epub": lambda data, charset, limits: parse_epub(data, limits.max_unpacked_bytes),
    "docx": lambda data, charset, limits: parse_docx(data, limits.max_unpacked_bytes),
}
SANDBOXED = frozenset({"pdf", "epub", "docx", "html"})  # parsers that do real work on untrusted structure


def parse_in_process(data: bytes, format: str, charset: str | None, limits: ParseLimits) -> ParsedDocument:
    return PARSERS[format](data, charset, limits)


def plain_text(text: str) -> ParsedDocument:
    """Text as it is, its chapter headings as sections."""
    return ParsedDocument(text, Layout("text", (), text_sections(text)))
