"""HTML (and EPUB's XHTML) to text: the main content without navigation, scripts, styles and page
furniture, headings kept as sections. Python's streaming HTMLParser builds no tree, so nesting
depth costs nothing; skipped elements are counted per tag, not kept on a stack."""

from __future__ import annotations

import re
from html.parser import HTMLParser

from engine.documents.parsed import TextBuilder
from engine.interface import ParsedDocument

SKIPPED = {"script", "style", "noscript", "template", "svg", "math", "nav", "aside", "form", "button", "select",
           "iframe", "object", "canvas", "head", "dialog"}  # fmt: skip
FURNITURE = {"header", "footer"}  # page furniture outside the main content; kept inside an article
BLOCKS = {"p", "div", "li", "ul", "ol", "br", "tr", "table", "section", "article", "main", "blockquote", "pre", "dt",
          "dd", "dl", "figure", "figcaption", "hr", "address", "caption", "td", "th", "body"}  # fmt: skip
HEADINGS = {f"h{n}": n for n in range(1, 7)}
MAIN = {"main", "article"}
HAS_MAIN = re.compile(rb"<(main|article)[\s>]|role=[\"']?main", re.IGNORECASE)


class _Extractor(HTMLParser):
    def __init__(self, builder: TextBuilder, only_main: bool) -> None:
        super().__init__(convert_charrefs=True)
        self.builder = builder
        self.only_main = only_main
        self.skipping: dict[str, int] = {}
        self.main_depth = 0  # <main> and <article> elements open
        self.role_main: str | None = None  # the tag of an open element with role="main"...
        self.role_main_nesting = 0  # ...and how many of that tag are open inside it and it
        self.heading: int | None = None
        self.words: list[str] = []
        self.title_parts: list[str] = []
        self.in_title = False

    def _skipped(self) -> bool:
        return any(self.skipping.values()) or (self.only_main and not self.main_depth)

    def _flush(self) -> None:
        text = " ".join("".join(self.words).split())
        self.words = []
        if not text:
            return
        if self.heading is not None:
            self.builder.heading(self.heading, text)
        else:
            self.builder.paragraph(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "title":
            self.in_title = True
        if tag == "body":
            self.skipping.pop("head", None)  # </head> is optional: the body ends the head
        if tag == self.role_main:
            self.role_main_nesting += 1
        elif self.role_main is None and ("role", "main") in attrs and tag not in MAIN:
            self.role_main, self.role_main_nesting = tag, 1
            self.main_depth += 1
        if tag in MAIN:
            self.main_depth += 1
        if tag in SKIPPED or (tag in FURNITURE and not self.main_depth):
            self._flush()
            self.skipping[tag] = self.skipping.get(tag, 0) + 1
        elif tag in HEADINGS:
            self._flush()
            self.heading = HEADINGS[tag]
        elif tag in BLOCKS:
            self._flush()

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self.in_title = False
        if self.skipping.get(tag):
            self.skipping[tag] -= 1
        elif tag in HEADINGS and self.heading is not None:
            self._flush()
            self.heading = None
        elif tag in BLOCKS:
            self._flush()
        if tag in MAIN and self.main_depth:
            self.main_depth -= 1
        if tag == self.role_main:
            self.role_main_nesting -= 1
            if not self.role_main_nesting:
                self.role_main = None
                self.main_depth -= 1

    def handle_data(self, data: str) -> None:
        if self.in_title:
            self.title_parts.append(data)
        elif not self._skipped():
            self.words.append(data)


def extract_html(text: str, builder: TextBuilder, *, only_main: bool | None = None) -> str | None:
    """Append the page's content to `builder`; returns its <title>."""
    if only_main is None:
        only_main = bool(HAS_MAIN.search(text.encode("utf-8", "ignore")[:1_000_000]))
    extractor = _Extractor(builder, only_main)
    extractor.feed(text)
    extractor.close()
    extractor._flush()
    title = " ".join(" ".join(extractor.title_parts).split())
    return title or None


def parse_html(text: str) -> ParsedDocument:
    builder = TextBuilder()
    title = extract_html(text, builder)
    if not builder.size and HAS_MAIN.search(text.encode("utf-8", "ignore")):
        title = extract_html(text, builder, only_main=False)  # an empty <main>: take the whole page
    return builder.build("html", title)
