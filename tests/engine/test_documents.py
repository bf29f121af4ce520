"""Parsing uploads: each format's text, pages and sections, format detection, and hostile files."""

from __future__ import annotations

import difflib
import io
import time
import zipfile

import pytest
from pypdf import PdfWriter

from engine.config import ParseLimits
from engine.documents import detect_format, parse_upload
from engine.documents.detect import decode_text
from engine.errors import DocumentError, UnsupportedFormatError
from engine.interface import DocumentInfo, Layout, Section, Upload
from research.evals.docfiles import Line, Page, book_pdf, make_docx, make_epub, make_pdf, make_zip
from tests.helpers import FIXTURES

LIMITS = ParseLimits()
BOOK = (FIXTURES / "alice29.txt").read_text(encoding="utf-8")
PARAGRAPHS = [" ".join(p.split()) for p in BOOK.split("\n\n") if len(p.split()) > 12]


def words_in_order(expected: list[str], got: list[str]) -> float:
    matcher = difflib.SequenceMatcher(None, expected, got, autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks()) / len(expected)


def parse(data: bytes, media_type: str = "", filename: str | None = None, limits: ParseLimits = LIMITS):
    return parse_upload(Upload(data, media_type, filename), limits)


@pytest.mark.parametrize("columns", [1, 2])
def test_pdf_text_in_reading_order_without_running_headers_with_each_page(columns):
    book = book_pdf(PARAGRAPHS, title="Alice in Tests", columns=columns, seed=columns)
    document = parse(book.pdf, "application/pdf")
    layout = document.layout
    assert layout.format == "pdf" and len(layout.pages) == book.pdf.count(b"/Type /Page ")
    assert words_in_order(book.words, document.text.split()) >= 0.99
    assert "Alice in Tests" not in document.text  # the running header, on every page
    body_lines = set(document.text.split("\n\n"))
    assert not any(line.strip().isdigit() for line in body_lines)  # page numbers
    pages_right = 0
    for paragraph, page in zip(PARAGRAPHS, book.page_of_paragraph, strict=True):
        at = document.text.find(" ".join(paragraph.split()[:12]))
        pages_right += at >= 0 and layout.page_range(at, at + 1)[0] - 1 == page
    assert pages_right >= 0.99 * len(PARAGRAPHS)
    assert [s.title for s in layout.sections] == [title for title, _ in book.outline]
    for section, (_, page) in zip(layout.sections, book.outline, strict=True):
        assert layout.page_range(section.start, section.start + 1)[0] == page + 1


def test_pdf_hyphenated_line_ends_are_joined():
    pdf = make_pdf([Page([Line(72, 700, "the extra-"), Line(72, 687, "ordinary counter-"), Line(72, 674, "revolution ends")])])
    assert parse(pdf).text == "the extraordinary counterrevolution ends"


def test_pdf_without_text_encrypted_corrupt_or_over_the_page_limit_is_refused():
    picture = make_pdf([Page()], drawing=b"0 0 1 rg 100 100 200 200 re f")
    with pytest.raises(DocumentError, match="no text layer"):
        parse(picture)
    plain = make_pdf([Page([Line(72, 700, "Hello secret world")])])
    writer = PdfWriter(clone_from=io.BytesIO(plain))
    writer.encrypt(user_password="secret", owner_password="owner", algorithm="RC4-128")
    encrypted = io.BytesIO()
    writer.write(encrypted)
    with pytest.raises(DocumentError, match="encrypted"):
        parse(encrypted.getvalue())
    for broken in (b"%PDF-1.4 nothing else", plain[: len(plain) // 2]):
        with pytest.raises(DocumentError, match="not a readable PDF"):
            parse(broken)
    with pytest.raises(DocumentError, match="limit is 2"):
        parse(make_pdf([Page([Line(72, 700, f"page {i}")]) for i in range(3)]), limits=ParseLimits(max_pages=2))


def test_format_comes_from_the_bytes_first_then_the_type_then_the_name():
    pdf = make_pdf([Page([Line(72, 700, "ascii pdf")])])
    assert detect_format(pdf, "text/plain") == "pdf"  # a PDF sent as text is still a PDF
    assert detect_format(make_docx([("", "x")]), "application/octet-stream") == "docx"
    assert detect_format(make_epub("t", [("c", ["p"])]), "") == "epub"
    assert detect_format(b"<!DOCTYPE html><p>x", "") == "html"  # known by its bytes when nothing is declared
    assert detect_format(b"<!DOCTYPE html><p>x", "text/plain") == "text"  # declared text stays text
    assert detect_format(b"Every PDF starts with %PDF-1.7", "text/plain") == "text"
    assert detect_format(make_docx([("", "x")]), "text/plain") == "text"
    assert detect_format(b"# Title", "", "notes.md") == "markdown"
    assert detect_format(b"# Title", "text/plain") == "text"
    with pytest.raises(UnsupportedFormatError, match="neither an EPUB nor a Word"):
        detect_format(make_zip({"a.txt": b"x"}))
    with pytest.raises(DocumentError, match="sent as PDF but is not one"):
        detect_format(b"hello", "application/pdf")
    with pytest.raises(UnsupportedFormatError):
        detect_format(b"<a/>", "application/xml")
    with pytest.raises(UnsupportedFormatError, match="not valid utf-8"):
        decode_text(b"\xff\xfe\xfa")


def test_epub_chapters_in_spine_order_with_titles():
    chapters = [("Down the Rabbit-Hole", ["Alice was beginning to get very tired."]), ("The Pool of Tears", ["Curiouser!"])]
    document = parse(make_epub("Alice", chapters, spine=[1, 0]))
    assert document.text == "The Pool of Tears\n\nCuriouser!\n\nDown the Rabbit-Hole\n\nAlice was beginning to get very tired."
    assert [(s.title, s.level) for s in document.layout.sections] == [("The Pool of Tears", 1), ("Down the Rabbit-Hole", 1)]
    assert document.layout.title == "Alice" and document.layout.format == "epub"
    assert document.layout.section_at(document.text.index("Alice was")) == "Down the Rabbit-Hole"


def test_docx_paragraphs_and_headings():
    blocks = [("Title", "Report"), ("Heading1", "Findings"), ("", "Sales rose."), ("Heading2", "Detail"), ("", "In May.")]
    document = parse(make_docx(blocks))
    assert document.text == "Report\n\nFindings\n\nSales rose.\n\nDetail\n\nIn May."
    assert [(s.title, s.level) for s in document.layout.sections] == [("Report", 1), ("Findings", 1), ("Detail", 2)]


def test_html_main_content_without_navigation_scripts_or_furniture():
    page = (
        b"<!doctype html><html><head><title>Guide</title><style>p{}</style><script>var x = '<p>no</p>';</script></head>"
        b"<body><header>Site name</header><nav><a>Home</a></nav><main><article><header><h1>Install</h1></header>"
        b"<p>Run the &amp; installer.</p><aside>Ad</aside><h2>Linux</h2><div>Use apt.</div></article></main>"
        b"<footer>Copyright</footer></body></html>"
    )
    document = parse(page, "text/html")
    assert document.text == "Install\n\nRun the & installer.\n\nLinux\n\nUse apt."
    assert [(s.title, s.level) for s in document.layout.sections] == [("Install", 1), ("Linux", 2)]
    assert document.layout.title == "Guide"
    whole = parse(b"<html><body><nav>menu</nav><p>Only a body.</p></body></html>", "text/html")
    assert whole.text == "Only a body."


def test_deeply_nested_html_parses_in_bounded_time():
    depth = 200_000
    page = b"<html><body>" + b"<div>" * depth + b"deep text" + b"</div>" * depth + b"</body></html>"
    started = time.perf_counter()
    assert parse(page, "text/html").text == "deep text"
    assert time.perf_counter() - started < 30


def test_markdown_keeps_its_text_and_finds_headings_outside_code():
    text = "# Guide\nIntro.\n\nSetup\n-----\n```\n# not a heading\n```\n## Use\nRun it.\n"
    document = parse(text.encode(), "text/markdown")
    assert document.text == text
    assert [(s.title, s.level) for s in document.layout.sections] == [("Guide", 1), ("Setup", 2), ("Use", 2)]
    assert all(text[s.start :].startswith(s.title) for s in document.layout.sections)


def test_a_zip_bomb_stops_at_the_unpacked_cap():
    bomb = make_zip({"word/document.xml": b"<w:document>" + b" " * (20 << 20) + b"</w:document>"})
    assert len(bomb) < 100_000
    with pytest.raises(DocumentError, match="unpacks to more than"):
        parse(bomb, limits=ParseLimits(max_unpacked_bytes=1 << 20))


def test_xml_document_types_are_refused_in_any_encoding():
    laughs = '<?xml version="1.0"?><!DOCTYPE d [<!ENTITY a "aaaa">]><w:document>&a;</w:document>'
    for data in (laughs.encode(), laughs.replace('"1.0"', '"1.0" encoding="UTF-16"').encode("utf-16")):
        with pytest.raises(DocumentError, match="document type"):
            parse(make_zip({"word/document.xml": data}))


def test_broken_zips_are_422_not_500():
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("mimetype", b"application/epub+zip")
    data = bytearray(out.getvalue())
    at = data.index(b"mimetype", 30) + len("mimetype")  # the local header's name, then the deflated bytes
    data[at : at + 8] = b"\xff" * 8
    with pytest.raises(DocumentError, match="damaged zip"):
        detect_format(bytes(data))


def test_an_encrypted_or_corrupt_member_is_a_document_error():
    from engine.documents.packages import parse_docx

    data = bytearray(make_zip({"word/document.xml": b"<w:document>" + b"x" * 4096 + b"</w:document>"}))
    encrypted = bytearray(data)
    for header, flags in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):  # general-purpose flag bit 0: encrypted
        encrypted[encrypted.index(header) + flags] |= 1
    with pytest.raises(DocumentError, match="cannot be read"):
        parse_docx(bytes(encrypted), 1 << 20)
    start = data.index(b"word/document.xml") + len("word/document.xml")  # the deflated bytes follow the name
    data[start : start + 16] = b"\xff" * 16
    with pytest.raises(DocumentError, match="cannot be read"):
        parse_docx(bytes(data), 1 << 20)


def test_markdown_headings_take_linear_time():
    line = "# a" + " #" * 200_000 + "x"
    started = time.perf_counter()
    document = parse(line.encode(), "text/markdown")
    assert time.perf_counter() - started < 2 and len(document.layout.sections) == 1


def test_html_without_a_closing_head_and_with_a_main_role():
    assert parse(b"<html><head><title>T</title><body><p>Hello there</p>", "text/html").text == "Hello there"
    page = b"<body><nav>n</nav><div role=main><div><p>A</p></div><p>B</p></div><footer>F</footer></body>"
    assert parse(page, "text/html").text == "A\n\nB"


def test_a_parse_over_its_time_or_memory_limit_is_stopped():
    book = book_pdf(PARAGRAPHS * 20, title="t")  # 1,000 pages: 2 s or more, past the child's start
    with pytest.raises(DocumentError, match="longer than"):
        parse(book.pdf, limits=ParseLimits(seconds=1.0))
    big = make_zip({"word/document.xml": b"<w:document>" + b" " * (200 << 20) + b"</w:document>"})
    with pytest.raises(DocumentError, match="more than 67108864 bytes|stopped"):
        parse(big, limits=ParseLimits(memory_bytes=64 << 20, max_unpacked_bytes=1 << 30))


def test_a_thousand_page_pdf_parses_at_over_fifty_pages_a_second():
    book = book_pdf(PARAGRAPHS * 20, title="Long", chapter_every=40)
    pages = book.pdf.count(b"/Type /Page ")
    assert pages >= 1000
    started = time.perf_counter()
    document = parse(book.pdf)
    seconds = time.perf_counter() - started
    assert len(document.layout.pages) == pages and pages / seconds > 50


def test_a_layout_survives_its_snapshot_form():
    layout = Layout("pdf", (0, 10, 25), (Section(0, 1, "One"), Section(12, 2, "Two")), "Title")
    info = DocumentInfo("d-1", "book.pdf", 30, 8, 1, 0.1, None, layout)
    import json
    from dataclasses import asdict

    assert DocumentInfo.from_dict(json.loads(json.dumps(asdict(info)))) == info
    assert DocumentInfo.from_dict({k: v for k, v in asdict(info).items() if k != "layout"}).layout == Layout()
    assert layout.page_range(5, 12) == (1, 2) and layout.page_range(25, 26) == (3, 3) and layout.section_at(11) == "One"
