"""Documents in the formats people keep them in (text, Markdown, HTML, PDF, EPUB, DOCX) to plain
text with pages and sections: `detect_format` names the format, `parse_cost` says what parsing it
may take, and `parse_detected` parses it, sandboxed where the parser does real work on untrusted
structure."""

from __future__ import annotations

from engine.config import ParseLimits
from engine.documents.detect import detect_format
from engine.documents.parsers import SANDBOXED, parse_in_process
from engine.documents.sandbox import parse_sandboxed
from engine.interface import ParsedDocument, Upload

__all__ = ["ParseLimits", "detect_format", "parse_cost", "parse_detected", "parse_upload"]


def parse_detected(upload: Upload, format: str, limits: ParseLimits) -> ParsedDocument:
    """Blocking (run it on a thread). Raises UnsupportedFormatError (415) or DocumentError (422)."""
    parse = parse_sandboxed if format in SANDBOXED else parse_in_process
    return parse(upload.data, format, upload.charset, limits)


def parse_upload(upload: Upload, limits: ParseLimits) -> ParsedDocument:
    """`detect_format`, then `parse_detected`; blocking."""
    return parse_detected(upload, detect_format(upload.data, upload.media_type, upload.filename), limits)


def parse_cost(upload: Upload, format: str, limits: ParseLimits) -> int:
    """Bytes to reserve while `upload` is parsed: a sandboxed parse's memory limit and the file, or
    the decoded text of a text body (up to 4 bytes a character in a Python string, besides the bytes)."""
    return limits.memory_bytes + len(upload.data) if format in SANDBOXED else 5 * len(upload.data)
