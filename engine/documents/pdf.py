"""PDF text in reading order with PDFium (pypdfium2, BSD-3/Apache-2.0): text runs per page, two
columns read one after the other, hyphenated line ends joined, running headers, footers and page
numbers dropped, and the page of every character kept. Sections come from the bookmarks."""

from __future__ import annotations

import re
import statistics
from collections import Counter
from dataclasses import dataclass

import pypdfium2 as pdfium

from engine.documents.parsed import TextBuilder
from engine.errors import DocumentError
from engine.interface import Layout, ParsedDocument, Section

PAGE_NUMBER = re.compile(r"^\W*(page\s+)?([0-9]+|[ivxlcdm]+)(\s*(of|/)\s*[0-9]+)?\W*$", re.IGNORECASE)
DOT_LEADER = re.compile(r"(?:\s?\.){4,}\s?")  # a table of contents' ". . . . ." between a title and its page
ROMAN = re.compile(r"\b[ivxlcdm]+\b")
RUNNING_PAGES = 3  # an edge line on this many pages is a running header or footer
EDGE_LINES = 2  # lines at the top and at the foot of a page that may be running headers or footers
SOFT_HYPHENS = "\u00ad\x02"


@dataclass
class Run:
    left: float
    bottom: float
    right: float
    top: float
    text: str


@dataclass
class PdfLine:
    top: float
    height: float
    text: str


def _runs(textpage: pdfium.PdfTextPage, width: float, height: float) -> list[Run]:
    """The page's text lines as PDFium reads them (its spacing, its joins of hyphenated line ends,
    marked U+FFFE), each placed by the boxes of its first and last characters."""
    text = textpage.get_text_range()
    if len(text) != textpage.count_chars():  # characters outside the BMP: no offsets to place lines by
        return [Run(0, 0, width, height, text.replace("\ufffe", "").replace("\r\n", " "))]
    runs = []
    start = 0
    for line in text.split("\r\n"):
        stripped = line.strip()
        if stripped:
            first = start + len(line) - len(line.lstrip())
            last = start + len(line.rstrip()) - 1
            left, bottom, _, top = textpage.get_charbox(first)
            _, last_bottom, right, last_top = textpage.get_charbox(last)
            text_line = DOT_LEADER.sub(" … ", stripped.replace("\ufffe", ""))
            runs.append(Run(left, min(bottom, last_bottom), max(right, left), max(top, last_top), text_line))
        start += len(line) + 2
    return runs


def _widest_band(covered: list[int], limit: int, step: float) -> float | None:
    """The middle x of the widest band (8 pt or more) in the page's middle 40% that at most `limit`
    runs cross: an empty band first, else one that a few full-width lines (titles) cross."""
    bins = len(covered)
    best, best_len, start = None, 0, None
    for b in range(int(bins * 0.3), int(bins * 0.7) + 1):
        if covered[b] <= limit:
            start = b if start is None else start
            if b - start + 1 > best_len:
                best, best_len = (start + b + 1) * step / 2, b - start + 1
        else:
            start = None
    return best if best_len * step >= 8 else None


def _gutter(runs: list[Run], width: float) -> float | None:
    """The x of an empty vertical band in the middle of the page with text on both sides, if any."""
    if len(runs) < 8:
        return None
    step = 2.0
    bins = int(width / step) + 1
    covered = [0] * bins
    for run in runs:
        for b in range(max(0, int(run.left / step)), min(bins, int(run.right / step) + 1)):
            covered[b] += 1
    best = _widest_band(covered, 0, step) or _widest_band(covered, max(1, len(runs) // 20), step)
    if best is None:
        return None
    left = sum(run.right <= best for run in runs)
    right = sum(run.left >= best for run in runs)
    return best if min(left, right) >= 2 else None


def _lines(runs: list[Run]) -> list[PdfLine]:
    """Runs on one baseline joined left to right, top to bottom."""
    lines: list[list[Run]] = []
    for run in sorted(runs, key=lambda r: (-r.top, r.left)):
        if lines and abs(lines[-1][0].top - run.top) < 0.5 * (run.top - run.bottom):
            lines[-1].append(run)
        else:
            lines.append([run])
    out = []
    for line in lines:
        line.sort(key=lambda r: r.left)
        text = " ".join(r.text.strip() for r in line)
        out.append(PdfLine(max(r.top for r in line), max(r.top - r.bottom for r in line), text))
    return out


def _reading_order(runs: list[Run], width: float) -> list[list[PdfLine]]:
    """Blocks of lines in reading order: what spans the columns above them, each column, what is below."""
    gutter = _gutter(runs, width)
    if gutter is None:
        return [_lines(runs)]
    left = [r for r in runs if r.right <= gutter]
    right = [r for r in runs if r.left >= gutter]
    spanning = [r for r in runs if r.left < gutter < r.right]
    top_of_columns = max(r.top for r in left + right)
    above = [r for r in spanning if r.top >= top_of_columns]
    below = [r for r in spanning if r.top < top_of_columns]
    return [b for b in (_lines(above), _lines(left), _lines(right), _lines(below)) if b]


def _edge_key(text: str) -> str:
    """A line with its numbers (arabic or roman: page numbers, chapter numbers) made alike."""
    return ROMAN.sub("#", re.sub(r"\d+", "#", text.strip().lower()))


def _leading(pages: list[list[list[PdfLine]]]) -> float:
    """The usual distance between consecutive lines of the document."""
    gaps = [
        a.top - b.top for blocks in pages for block in blocks for a, b in zip(block, block[1:], strict=False) if a.top > b.top
    ]
    return statistics.median(gaps) if gaps else 0.0


def _edges(blocks: list[list[PdfLine]], leading: float) -> list[PdfLine]:
    """Lines set apart at the top or the foot of a page (a gap over 1.5 leadings from the body):
    where running headers, footers and page numbers sit. A body line is never one."""
    lines = sorted((line for block in blocks for line in block), key=lambda line: -line.top)
    if len(lines) < 2 or not leading:
        return lines[:1] + lines[-1:] if lines else []
    edges = []
    for ordered in (lines, lines[::-1]):
        for depth in range(min(EDGE_LINES, len(ordered) - 1)):
            if abs(ordered[depth].top - ordered[depth + 1].top) > 1.5 * leading:
                edges.extend(ordered[: depth + 1])
                break
    return edges


def _running_lines(edges: list[list[PdfLine]]) -> set[str]:
    """Keys of edge lines (each page's `_edges`) found on many pages: running headers and footers."""
    counts: Counter[str] = Counter()
    for page_edges in edges:
        counts.update({_edge_key(line.text) for line in page_edges})
    return {key for key, n in counts.items() if n >= RUNNING_PAGES}


def _paragraphs(blocks: list[list[PdfLine]], edges: list[PdfLine], running: set[str], leading: float) -> list[str]:
    """A page's paragraphs: lines joined (hyphenated ends mended), a wide gap starts a new one;
    its `edges` that are page numbers or `running` lines left out."""
    paragraphs: list[str] = []
    current = ""
    for block in blocks:
        previous: PdfLine | None = None
        for line in block:
            if any(line is e for e in edges) and (PAGE_NUMBER.match(line.text) or _edge_key(line.text) in running):
                continue
            text = line.text.strip()
            if previous is not None and leading and previous.top - line.top > 1.5 * leading and current:
                paragraphs.append(current)
                current = ""
            current = _join(current, text)
            previous = line
    if current:
        paragraphs.append(current)
    return paragraphs


def _join(text: str, line: str) -> str:
    if not text:
        return line
    if text[-1] in SOFT_HYPHENS:
        return text[:-1] + line
    if text.endswith("-") and len(text) > 1 and text[-2].isalpha() and line[:1].islower():
        return text[:-1] + line
    return f"{text} {line}"


def _runs_on(previous: str, paragraph: str) -> bool:
    """Whether a page's first paragraph carries on the last page's last one: that one stops
    without closing punctuation, or this one starts in lower case."""
    return bool(previous) and (paragraph[:1].islower() or previous[-1] not in ".!?:;'\"”’)]*")


def _sections(pdf: pdfium.PdfDocument, builder: TextBuilder, text: str) -> tuple[Section, ...]:
    """Bookmarks, each placed where its title appears on its page (else where the page starts)."""
    sections = []
    try:
        toc = list(pdf.get_toc(max_depth=6))
    except pdfium.PdfiumError:
        return ()
    for item in toc:
        title = " ".join((item.get_title() or "").split())
        dest = item.get_dest()
        page = dest.get_index() if dest is not None else None
        if not title or page is None or not 0 <= page < len(builder.pages):
            continue
        start = builder.pages[page]
        end = builder.pages[page + 1] if page + 1 < len(builder.pages) else len(text)
        found = re.compile(re.escape(title), re.IGNORECASE).search(text, start, end)  # this page only
        sections.append(Section(found.start() if found else start, item.level + 1, title))
    return tuple(sorted(sections, key=lambda s: s.start))


def parse_pdf(data: bytes, max_pages: int) -> ParsedDocument:
    try:
        pdf = pdfium.PdfDocument(data)
    except pdfium.PdfiumError as exc:
        reason = str(exc)
        if "password" in reason.lower():
            raise DocumentError("the PDF is encrypted with a password; send it decrypted") from None
        raise DocumentError(f"the file is not a readable PDF ({reason})") from None
    try:
        if len(pdf) > max_pages:
            raise DocumentError(f"the PDF has {len(pdf)} pages; the limit is {max_pages} (LONGDOC_MAX_DOCUMENT_PAGES)")
        pages = []
        for index in range(len(pdf)):
            page = pdf[index]
            textpage = page.get_textpage()
            pages.append(_reading_order(_runs(textpage, page.get_width(), page.get_height()), page.get_width()))
            textpage.close()
            page.close()
        leading = _leading(pages)
        edges = [_edges(blocks, leading) for blocks in pages]
        running = _running_lines(edges)
        builder = TextBuilder()
        last = ""
        for blocks, page_edges in zip(pages, edges, strict=True):
            builder.page()
            for number, paragraph in enumerate(_paragraphs(blocks, page_edges, running, leading)):
                builder.paragraph(paragraph, continues=number == 0 and _runs_on(last, paragraph))
                last = paragraph
        if not builder.size:
            raise DocumentError("the PDF has no text layer (scanned pages?); longdoc does not read text from images")
        document = builder.build("pdf")
        title = pdf.get_metadata_value("Title") or None
        layout = Layout("pdf", document.layout.pages, _sections(pdf, builder, document.text), title)
        return ParsedDocument(document.text, layout)
    finally:
        pdf.close()
