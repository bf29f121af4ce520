"""Documents in the formats people keep them in (text, Markdown, HTML, PDF, EPUB, DOCX) to plain
text with pages and sections: `parse_upload` detects the format and parses it, sandboxed where
the parser does real work on untrusted structure."""

from __future__ import annotations

from engine.config import ParseLimits
from engine.documents.detect import detect_format
from engine.documents.parsers import SANDBOXED, parse_in_process
from engine.documents.sandbox import parse_sandboxed
from engine.errors import LongdocError
from engine.interface import ParsedDocument, Upload

__all__ = ["ParseLimits", "detect_format", "parse_cost", "parse_upload"]


def parse_upload(upload: Upload, limits: ParseLimits) -> ParsedDocument:
    """Blocking (run it on a thread). Raises UnsupportedFormatError (415) or DocumentError (422)."""
    format = detect_format(upload.data, upload.media_type, upload.filename)
    parse = parse_sandboxed if format in SANDBOXED else parse_in_process
    return parse(upload.data, format, upload.charset, limits)


def parse_cost(upload: Upload, limits: ParseLimits) -> int:
    """Bytes to reserve while `upload` is parsed: a sandboxed parse's memory limit, or the decoded
    text of a text body (up to 4 bytes a character in a Python string, besides the bytes)."""
    try:
        sandboxed = detect_format(upload.data, upload.media_type, upload.filename) in SANDBOXED
    except LongdocError:
        sandboxed = False  # parse_upload says what is wrong
    return limits.memory_bytes + len(upload.data) if sandboxed else 5 * len(upload.data)
