"""Which format a file is: its content first (magic bytes, zip members, an HTML opening), then
the declared media type, then the file name's extension."""

from __future__ import annotations

import codecs
import io
import re
import zipfile

from engine.errors import DocumentError, UnsupportedFormatError

MEDIA_TYPES = {
    "application/pdf": "pdf",
    "application/epub+zip": "epub",
    "application/vnd.openxmlformats-officedocument.wordprocessingml.document": "docx",
    "text/html": "html",
    "application/xhtml+xml": "html",
    "text/markdown": "markdown",
    "text/x-markdown": "markdown",
    "text/plain": "text",
}
EXTENSIONS = {".pdf": "pdf", ".epub": "epub", ".docx": "docx", ".html": "html", ".htm": "html", ".xhtml": "html",
              ".md": "markdown", ".markdown": "markdown", ".txt": "text", ".text": "text"}  # fmt: skip
BINARY = ("pdf", "epub", "docx")
HTML_START = re.compile(rb"^\s*(<\?xml[^>]*>\s*)?(<!--.*?-->\s*)*<(!doctype\s+html|html[\s>])", re.IGNORECASE | re.DOTALL)
ACCEPTED = sorted(set(MEDIA_TYPES) | {"application/octet-stream"})


def _zip_kind(data: bytes) -> str:
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        names = set(archive.namelist())
        if "mimetype" in names and archive.getinfo("mimetype").file_size < 64:
            if archive.read("mimetype").strip() == b"application/epub+zip":
                return "epub"
    except Exception as exc:  # noqa: BLE001 - zipfile raises RuntimeError, zlib.error and more on broken archives
        raise DocumentError(f"the file is a damaged zip archive ({type(exc).__name__}: {exc})") from None
    if "META-INF/container.xml" in names:
        return "epub"
    if "word/document.xml" in names:
        return "docx"
    raise UnsupportedFormatError("the file is a zip archive but neither an EPUB nor a Word (.docx) document")


def declared_format(media_type: str, filename: str | None) -> str | None:
    if media_type in MEDIA_TYPES:
        return MEDIA_TYPES[media_type]
    suffix = "." + filename.rsplit(".", 1)[-1].lower() if filename and "." in filename else ""
    return EXTENSIONS.get(suffix)


def detect_format(data: bytes, media_type: str = "", filename: str | None = None) -> str:
    """ "pdf", "epub", "docx", "html", "markdown" or "text"; UnsupportedFormatError for anything else.
    What is declared as text (text/plain, HTML, Markdown, or such a name) is that, unless it starts
    as a PDF does; what is declared as nothing or as a binary type is known by its bytes."""
    head = data[:1024]
    declared = declared_format(media_type, filename)
    textual = declared in ("text", "markdown", "html")
    if head.startswith(b"%PDF-") or (not textual and b"%PDF-" in head):
        return "pdf"
    if head.startswith(b"PK\x03\x04") and not textual:
        return _zip_kind(data)
    if declared in BINARY:
        raise DocumentError(f"the file was sent as {declared.upper()} but is not one (its first bytes are {head[:8]!r})")
    if media_type and media_type not in ACCEPTED and declared is None:
        raise UnsupportedFormatError(f"longdoc reads {', '.join(ACCEPTED)}; not {media_type}")
    if declared is not None:
        return declared
    return "html" if HTML_START.match(head) else "text"


CHARSET = re.compile(rb"<meta[^>]+charset=[\"']?([\w-]+)", re.IGNORECASE)


def decode_text(data: bytes, charset: str | None = None, *, html: bool = False) -> str:
    """Bytes to text in the declared charset (UTF-8 when none; an HTML page may declare its own)."""
    if charset is None and html and (meta := CHARSET.search(data[:4096])):
        charset = meta.group(1).decode("ascii")
    charset = charset or "utf-8"
    try:
        codec = codecs.lookup(charset).name
    except LookupError:
        raise UnsupportedFormatError(f"unknown charset {charset!r}") from None
    if codec == "utf-8":
        codec = "utf-8-sig"  # drop a byte-order mark
    try:
        return data.decode(codec)
    except UnicodeDecodeError as exc:
        raise UnsupportedFormatError(f"the document is not valid {charset} text ({exc.reason})") from None
