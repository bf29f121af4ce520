"""EPUB and DOCX: zip packages read member by member under a cap on what they unpack to (a zip
bomb stops at the cap, whatever its headers claim), their XML refused when it declares entities."""

from __future__ import annotations

import io
import posixpath
import re
import zipfile
from xml.etree import ElementTree

from engine.documents.html import extract_html
from engine.documents.parsed import TextBuilder
from engine.errors import DocumentError
from engine.interface import ParsedDocument

MAX_MEMBERS = 10_000
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
        except (zipfile.BadZipFile, ValueError, EOFError) as exc:
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
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, NotImplementedError) as exc:
            raise DocumentError(f"the {self.kind} file's member {name!r} cannot be read ({exc})") from None
        return b"".join(chunks)

    def xml(self, name: str) -> ElementTree.Element:
        data = self.read(name)
        if b"<!ENTITY" in data:
            raise DocumentError(f"the {self.kind} file's {name!r} declares XML entities; longdoc does not expand them")
        try:
            return ElementTree.fromstring(data)
        except ElementTree.ParseError as exc:
            raise DocumentError(f"the {self.kind} file's {name!r} is not well-formed XML ({exc})") from None


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


def _docx_text(paragraph: ElementTree.Element) -> str:
    parts = []
    for element in paragraph.iter():
        name = _local(element.tag)
        if name == "t" and element.text:
            parts.append(element.text)
        elif name in ("tab", "br", "cr"):
            parts.append(" ")
    return "".join(parts)


def parse_docx(data: bytes, max_unpacked: int) -> ParsedDocument:
    package = Package(data, max_unpacked, "DOCX")
    body = package.xml("word/document.xml")
    builder = TextBuilder()
    for paragraph in _children(body, "p"):
        text = _docx_text(paragraph)
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
    for itemref in _children(opf, "itemref"):
        href = manifest.get(itemref.get("idref"))
        if not href:
            continue
        name = posixpath.normpath(posixpath.join(base, href.split("#")[0]))
        chapter = package.read(name).decode("utf-8", errors="replace")
        if "<!ENTITY" in chapter:
            raise DocumentError(f"the EPUB file's {name!r} declares XML entities; longdoc does not expand them")
        extract_html(chapter, builder)
    return builder.build("epub", title)
