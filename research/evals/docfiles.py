"""Generated PDF, DOCX and EPUB files whose text, pages and sections are known, for the parsers'
tests and `longdoc eval pdf`. Written by hand (no PDF or Office library), so the files hold exactly
what a test expects: Helvetica text lines at known places, running headers, page numbers, two
columns, hyphenated line ends and a bookmark outline.
"""

from __future__ import annotations

import io
import random
import zipfile
from dataclasses import dataclass, field

PAGE_WIDTH, PAGE_HEIGHT = 612, 792
FONT_SIZE, LEADING = 10, 13
CHAR_WIDTH = 5.0  # Helvetica at 10 pt averages about 5 pt a character


@dataclass
class Line:
    x: float
    y: float
    text: str


@dataclass
class Page:
    lines: list[Line] = field(default_factory=list)


def _pdf_string(text: str) -> bytes:
    raw = text.encode("cp1252", errors="replace")
    return b"(" + raw.replace(b"\\", b"\\\\").replace(b"(", b"\\(").replace(b")", b"\\)") + b")"


def make_pdf(pages: list[Page], outline: tuple[tuple[str, int], ...] | list[tuple[str, int]] = (), drawing: bytes = b"") -> bytes:
    """A PDF of `pages` (text lines in Helvetica) with `outline` bookmarks (title, page index);
    `drawing` (content-stream operators) is painted on every page, e.g. a picture with no text."""
    objects: list[bytes] = []

    def add(body: bytes) -> int:
        objects.append(body)
        return len(objects)

    catalog = add(b"")  # filled in below, once the outline's number is known
    pages_ref = add(b"")
    font = add(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>")
    page_refs = []
    for page in pages:
        stream = b"BT /F1 %d Tf " % FONT_SIZE
        for line in page.lines:
            stream += b"1 0 0 1 %.1f %.1f Tm %s Tj " % (line.x, line.y, _pdf_string(line.text))
        stream += b"ET " + drawing
        contents = add(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream))
        page_refs.append(
            add(
                b"<< /Type /Page /Parent %d 0 R /MediaBox [0 0 %d %d] /Resources << /Font << /F1 %d 0 R >> >> /Contents %d 0 R >>"
                % (pages_ref, PAGE_WIDTH, PAGE_HEIGHT, font, contents)
            )
        )
    kids = b" ".join(b"%d 0 R" % ref for ref in page_refs)
    objects[pages_ref - 1] = b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, len(page_refs))
    outline_entry = b""
    if outline:
        root = add(b"")
        items = [len(objects) + 1 + i for i in range(len(outline))]
        for i, (title, page_index) in enumerate(outline):
            links = b"/Parent %d 0 R" % root
            links += b" /Prev %d 0 R" % items[i - 1] if i else b""
            links += b" /Next %d 0 R" % items[i + 1] if i + 1 < len(items) else b""
            dest = b"/Dest [%d 0 R /XYZ 0 %d 0]" % (page_refs[page_index], PAGE_HEIGHT)
            add(b"<< /Title %s %s %s >>" % (_pdf_string(title), links, dest))
        objects[root - 1] = b"<< /Type /Outlines /First %d 0 R /Last %d 0 R /Count %d >>" % (items[0], items[-1], len(items))
        outline_entry = b" /Outlines %d 0 R" % root
    objects[catalog - 1] = b"<< /Type /Catalog /Pages %d 0 R%s >>" % (pages_ref, outline_entry)
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n%s\nendobj\n" % (number, body))
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    for offset in offsets:
        out.write(b"%010d 00000 n \n" % offset)
    out.write(b"trailer\n<< /Size %d /Root %d 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, catalog, xref))
    return out.getvalue()


@dataclass
class Book:
    """A generated PDF and what a parser should find in it."""

    pdf: bytes
    words: list[str]  # the body's words in reading order, hyphenated words whole
    page_of_paragraph: list[int]  # 0-based page where each paragraph starts
    headers: list[str]  # running header and footer lines a parser must drop
    outline: list[tuple[str, int]]


def _wrap(words: list[str], width: int, rng: random.Random) -> list[str]:
    """Lines of at most `width` characters; now and then a long word is hyphenated across lines."""
    lines, current = [], ""
    for word in words:
        candidate = f"{current} {word}" if current else word
        if len(candidate) <= width:
            current = candidate
            continue
        room = width - len(current) - 2
        if len(word) >= 8 and room >= 4 and word.isalpha() and rng.random() < 0.5:
            cut = min(room, len(word) - 3)
            lines.append(f"{current} {word[:cut]}-")
            current = word[cut:]
            continue
        lines.append(current)
        current = word
    if current:
        lines.append(current)
    return lines


def book_pdf(paragraphs: list[str], *, title: str, columns: int = 1, seed: int = 0, chapter_every: int = 12) -> Book:
    """Paragraphs typeset on US-letter pages: a running header (title, chapter), the page number
    at the foot, one or two columns, hyphenated line ends, a bookmark per chapter."""
    rng = random.Random(seed)
    gutter = 24
    column_width = (PAGE_WIDTH - 144 - gutter * (columns - 1)) / columns
    chars = int(column_width / CHAR_WIDTH)
    top, bottom = PAGE_HEIGHT - 90, 80
    rows = int((top - bottom) / LEADING)
    pages: list[Page] = []
    page_of_paragraph: list[int] = []
    outline: list[tuple[str, int]] = []
    headers: list[str] = []
    column, row = columns, rows  # forces a new page first
    chapter = 0

    def new_page() -> None:
        number = len(pages) + 1
        header = f"{title} — Chapter {chapter}"
        footer = f"{number}"
        pages.append(Page([Line(72, PAGE_HEIGHT - 50, header), Line(PAGE_WIDTH / 2, 40, footer)]))
        headers.extend([header, footer])

    for index, paragraph in enumerate(paragraphs):
        if index % chapter_every == 0:
            chapter += 1
            column, row = columns, rows
        lines = _wrap(paragraph.split(), chars, rng)
        if row + 1 >= rows:
            row, column = 0, column + 1
        else:
            row += 1  # a blank line between paragraphs
        if column >= columns:
            new_page()
            column, row = 0, 0
        if index % chapter_every == 0:
            outline.append((f"Chapter {chapter}", len(pages) - 1))
        for number, text in enumerate(lines):
            if row >= rows:
                row, column = 0, column + 1
                if column >= columns:
                    new_page()
                    column = 0
            if number == 0:
                page_of_paragraph.append(len(pages) - 1)
            x = 72 + column * (column_width + gutter)
            pages[-1].lines.append(Line(x, top - row * LEADING, text))
            row += 1
    words = [w for p in paragraphs for w in p.split()]
    return Book(make_pdf(pages, outline), words, page_of_paragraph, headers, outline)


def make_zip(members: dict[str, bytes], stored: tuple[str, ...] = ()) -> bytes:
    """A zip of `members`, deflated but for those named in `stored`."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data, zipfile.ZIP_STORED if name in stored else zipfile.ZIP_DEFLATED)
    return out.getvalue()


def _xml_text(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def make_docx(blocks: list[tuple[str, str]]) -> bytes:
    """A Word file of (style, text) blocks; style is "Title", "Heading1", "Heading2" or "" (body)."""
    ns = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
    body = ""
    for style, text in blocks:
        props = f'<w:pPr><w:pStyle w:val="{style}"/></w:pPr>' if style else ""
        body += f'<w:p>{props}<w:r><w:t xml:space="preserve">{_xml_text(text)}</w:t></w:r></w:p>'
    document = f'<?xml version="1.0" encoding="UTF-8"?><w:document xmlns:w="{ns}"><w:body>{body}</w:body></w:document>'
    content_types = (
        '<?xml version="1.0" encoding="UTF-8"?><Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types">'
        '<Default Extension="xml" ContentType="application/xml"/>'
        '<Override PartName="/word/document.xml" '
        'ContentType="application/vnd.openxmlformats-officedocument.wordprocessingml.document.main+xml"/></Types>'
    )
    return make_zip({"[Content_Types].xml": content_types.encode(), "word/document.xml": document.encode()})


def make_epub(title: str, chapters: list[tuple[str, list[str]]], spine: list[int] | None = None) -> bytes:
    """An EPUB 3 of (chapter title, paragraphs); the spine reads them in `spine` order (default: as given),
    while the manifest and the archive list them as given."""
    container = (
        '<?xml version="1.0"?><container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:container">'
        '<rootfiles><rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/></rootfiles></container>'
    )
    manifest, members = "", {}
    for i, (heading, paragraphs) in enumerate(chapters):
        body = "".join(f"<p>{_xml_text(p)}</p>" for p in paragraphs)
        members[f"OEBPS/ch{i}.xhtml"] = (
            f'<?xml version="1.0" encoding="utf-8"?><html xmlns="http://www.w3.org/1999/xhtml"><head><title>{_xml_text(heading)}'
            f"</title><style>p {{ margin: 0 }}</style></head><body><h1>{_xml_text(heading)}</h1>{body}</body></html>"
        ).encode()
        manifest += f'<item id="ch{i}" href="ch{i}.xhtml" media-type="application/xhtml+xml"/>'
    spine_refs = "".join(f'<itemref idref="ch{i}"/>' for i in (spine if spine is not None else range(len(chapters))))
    opf = (
        '<?xml version="1.0" encoding="utf-8"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0">'
        f'<metadata xmlns:dc="http://purl.org/dc/elements/1.1/"><dc:title>{_xml_text(title)}</dc:title></metadata>'
        f"<manifest>{manifest}</manifest><spine>{spine_refs}</spine></package>"
    )
    return make_zip(
        {"mimetype": b"application/epub+zip", "META-INF/container.xml": container.encode(), "OEBPS/content.opf": opf.encode()}
        | members,
        stored=("mimetype",),
    )
