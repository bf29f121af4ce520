"""EPUB and DOCX: zip packages read member by member under a cap on what they unpack to (a zip
bomb stops at the cap, whatever its headers claim), their XML refused when it declares entities."""

from __future__ import annotations

import codecs
import io
import posixpath
import re
import zipfile
from collections.abc import Iterator
from urllib.parse import unquote
from xml.etree import ElementTree
from xml.parsers import expat

from engine.documents.html import extract_html
from engine.documents.parsed import TextBuilder
from engine.errors import DocumentError
from engine.interface import ParsedDocument

MAX_MEMBERS = 10_000
XML_ENCODING = re.compile(rb"""^\s*<\?xml[^>]*encoding=["']([\w.-]+)["']""")
READ_CHUNK = 1 << 16


class Package:
    """A zip archive whose members are read with a shared budget of unpacked bytes."""

    def __init__(self, data: bytes, max_unpacked: int, kind: str) -> None:
        self.kind = kind
        self.left = max_unpacked
        self.max_unpacked = max_unpacked
        try:
            self.zip = zipfile.ZipFile(io.BytesIO(data))
            self.names = set(self.zip.namelist())
        except Exception as exc:  # noqa: BLE001 - zipfile raises many kinds on a broken archive
            raise DocumentError(f"the {kind} file is not a readable zip archive ({exc})") from None
        if len(self.names) > MAX_MEMBERS:
            raise DocumentError(f"the {kind} file has {len(self.names)} members; the limit is {MAX_MEMBERS}")

    def read(self, name: str) -> bytes:
        if name not in self.names:
            raise DocumentError(f"the {self.kind} file lacks {name!r}")
        chunks = []
        try:
            with self.zip.open(name) as member:
                while chunk := member.read(min(READ_CHUNK, self.left + 1)):
                    self.left -= len(chunk)
                    if self.left < 0:
                        raise DocumentError(
                            f"the {self.kind} file unpacks to more than {self.max_unpacked} bytes "
                            "(LONGDOC_MAX_UNPACKED_BYTES); a zip bomb?"
                        )
                    chunks.append(chunk)
        except (DocumentError, MemoryError):
            raise  # a member over the parse's memory is said as such by the sandbox
        except Exception as exc:  # noqa: BLE001 - RuntimeError (encrypted), zlib.error (corrupt) and more
            raise DocumentError(f"the {self.kind} file's member {name!r} cannot be read ({type(exc).__name__}: {exc})") from None
        return b"".join(chunks)

    def xml(self, name: str) -> ElementTree.Element:
        """A member parsed as XML; one with a document type declaration (where entities are
        declared, in any encoding) is refused: these formats need none."""
        data = self.read(name)
        if _declares_doctype(data):
            raise DocumentError(f"the {self.kind} file's {name!r} declares a document type; longdoc does not read those")
        try:
            return ElementTree.fromstring(data)
        except ElementTree.ParseError as exc:
            raise DocumentError(f"the {self.kind} file's {name!r} is not well-formed XML ({exc})") from None


class _Prolog(Exception):
    """Raised at the first element: the prolog, where a document type would be, is over."""

    def __init__(self, doctype: bool) -> None:
        self.doctype = doctype


def _declares_doctype(data: bytes) -> bool:
    """Whether XML declares a document type before its first element (expat reads its encoding)."""

    def doctype(*_: object) -> None:
        raise _Prolog(True)

    def element(*_: object) -> None:
        raise _Prolog(False)

    parser = expat.ParserCreate()
    parser.StartDoctypeDeclHandler = doctype
    parser.StartElementHandler = element
    try:
        parser.Parse(data, True)
    except _Prolog as prolog:
        return prolog.doctype
    except expat.ExpatError:
        return False  # ElementTree says what is wrong with it
    return False


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _children(element: ElementTree.Element, name: str) -> list[ElementTree.Element]:
    return [e for e in element.iter() if _local(e.tag) == name]


# --- DOCX ---

HEADING_STYLE = re.compile(r"(?:heading|berschrift|titre|titolo|ttulo)\s*([1-9])$", re.IGNORECASE)


def _docx_level(paragraph: ElementTree.Element) -> int | None:
    """1 for Title, n for Heading n (or an outline level n - 1), None for body text."""
    for element in paragraph:
        if _local(element.tag) != "pPr":
            continue
        for prop in element:
            value = next((v for k, v in prop.attrib.items() if _local(k) == "val"), "")
            if _local(prop.tag) == "pStyle":
                if value.lower() == "title":
                    return 1
                if match := HEADING_STYLE.search(value.replace("-", "")):
                    return int(match.group(1))
            if _local(prop.tag) == "outlineLvl" and value.isdigit() and int(value) < 9:
                return int(value) + 1
    return None


def _docx_text(element: ElementTree.Element, parts: list[str]) -> None:
    """The text of a paragraph's runs; an alternative's fallback (the same text again) is skipped."""
    for child in element:
        name = _local(child.tag)
        if name == "Fallback":
            continue
        if name == "t" and child.text:
            parts.append(child.text)
        elif name in ("tab", "br", "cr"):
            parts.append(" ")
        _docx_text(child, parts)


def _outer_paragraphs(element: ElementTree.Element) -> Iterator[ElementTree.Element]:
    """Paragraphs not inside another paragraph (a text box's are read with the paragraph holding it)."""
    for child in element:
        if _local(child.tag) == "p":
            yield child
        else:
            yield from _outer_paragraphs(child)


def parse_docx(data: bytes, max_unpacked: int) -> ParsedDocument:
    package = Package(data, max_unpacked, "DOCX")
    body = package.xml("word/document.xml")
    builder = TextBuilder()
    for paragraph in _outer_paragraphs(body):
        parts: list[str] = []
        _docx_text(paragraph, parts)
        text = "".join(parts)
        level = _docx_level(paragraph)
        if level is None:
            builder.paragraph(text)
        else:
            builder.heading(level, text)
    return builder.build("docx")


# --- EPUB ---


def _opf_path(package: Package) -> str:
    container = package.xml("META-INF/container.xml")
    for rootfile in _children(container, "rootfile"):
        if path := rootfile.get("full-path"):
            return path
    raise DocumentError("the EPUB file's container names no package document")


def parse_epub(data: bytes, max_unpacked: int) -> ParsedDocument:
    """Chapters in spine order; each chapter's headings become sections."""
    package = Package(data, max_unpacked, "EPUB")
    opf_path = _opf_path(package)
    opf = package.xml(opf_path)
    base = posixpath.dirname(opf_path)
    manifest = {item.get("id"): item.get("href", "") for item in _children(opf, "item")}
    title = next((e.text for e in opf.iter() if _local(e.tag) == "title" and e.text), None)
    builder = TextBuilder()
    read = 0
    for itemref in _children(opf, "itemref"):
        href = manifest.get(itemref.get("idref"))
        name = posixpath.normpath(posixpath.join(base, unquote(href.split("#")[0]))) if href else ""
        if name not in package.names:
            continue  # a spine entry without its file: the rest of the book is still read
        data = package.read(name)
        declared = XML_ENCODING.match(data)
        # the HTML reader expands no entities a chapter declares: its text is read as text
        extract_html(data.decode(_codec(declared.group(1).decode("ascii") if declared else "utf-8"), errors="replace"), builder)
        read += 1
    if not read:
        raise DocumentError("the EPUB file's spine names no chapter it holds")
    return builder.build("epub", title)


def _codec(name: str) -> str:
    try:
        return codecs.lookup(name).name
    except LookupError:
        return "utf-8"
