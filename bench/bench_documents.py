"""Documents in real formats, measured (docs/studies/documents.md):

1. real manuals from Debian packages (`make documents`): pages, parse time, sections; where one
   manual comes in two formats, how many of the words of the HTML/EPUB text the PDF text has in
   the same order;
2. generated PDFs (one and two columns, running headers, page numbers, hyphenated line ends) of
   300 pages: words of the source in order, header lines left, pages a second;
3. through REST against `longdoc serve`: a 300-page PDF with invented facts on known pages, and the
   same text posted as .txt; ingestion time of each, answers right, and whether the passage that
   holds each fact cites its page.

    make bench-documents   # or: .venv/bin/python -m bench.bench_documents [--facts 20] [--model NAME]
"""

from __future__ import annotations

import argparse
import difflib
import random
import statistics
import time

import httpx

from engine.config import DEFAULT_MODEL, ParseLimits
from engine.documents import parse_upload
from engine.interface import ParsedDocument, Upload
from research.evals.docfiles import book_pdf
from research.evals.needles import KINDS, LAST, draw
from research.evals.realdocs import PAIRS, fetch
from research.training.corpus import DEFAULT_DIR, HELD_OUT
from scripts.drills.server import Server

THINGS = ("observatory", "harbour tunnel", "river museum", "archive", "glassworks", "signal tower", "mill", "chapel")


def words_in_order(expected: list[str], got: list[str]) -> float:
    """The share of `expected`'s words that `got` has in the same order (difflib's matching blocks)."""
    matcher = difflib.SequenceMatcher(None, expected, got, autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks()) / max(1, len(expected))


def timed_parse(data: bytes, name: str) -> tuple[ParsedDocument, float]:
    started = time.perf_counter()
    document = parse_upload(Upload(data, "", name), ParseLimits())
    return document, time.perf_counter() - started


def real_files() -> None:
    paths = fetch()
    print("| file | format | pages | parse s | pages/s | characters | sections |")
    print("|---|---|---|---|---|---|---|")
    texts = {}
    for name, path in paths.items():
        document, seconds = min((timed_parse(path.read_bytes(), name) for _ in range(3)), key=lambda r: r[1])
        texts[name] = document.text
        pages = len(document.layout.pages)
        rate = f"{pages / seconds:.0f}" if pages else "–"
        print(
            f"| {name} | {document.layout.format} | {pages or '–'} | {seconds:.2f} | {rate} | {len(document.text):,} | {len(document.layout.sections)} |"
        )
    print()
    print("| PDF | against | words of the other in order in the PDF's text |")
    print("|---|---|---|")
    for pdf, other in PAIRS:
        # words compared lower-cased and without punctuation: the formats quote and dash differently
        def norm(text: str) -> list[str]:
            return [w for w in ("".join(c for c in word if c.isalnum()).lower() for word in text.split()) if w]

        print(f"| {pdf} | {other} | {words_in_order(norm(texts[other]), norm(texts[pdf])):.3f} |")
    print()


def filler_paragraphs(rng: random.Random, count: int) -> list[str]:
    """Paragraphs of 40-140 words cut from the held-out books, in order, cycling when they run out."""
    words = [w for name in HELD_OUT for w in (DEFAULT_DIR / name).read_text(encoding="utf-8").split()]
    paragraphs, at = [], 0
    for _ in range(count):
        size = rng.randrange(40, 140)
        if at + size > len(words):
            at = 0
        paragraphs.append(" ".join(words[at : at + size]))
        at += size
    return paragraphs


def book_of(paragraphs: list[str], pages_wanted: int, columns: int, seed: int):
    """A generated PDF of about `pages_wanted` pages: the paragraphs cut to fit after a first try."""
    book = book_pdf(paragraphs, title="A Generated Chronicle", columns=columns, seed=seed, chapter_every=30)
    pages = len(set(book.page_of_paragraph))
    keep = int(len(paragraphs) * pages_wanted / pages)
    return book_pdf(paragraphs[:keep], title="A Generated Chronicle", columns=columns, seed=seed, chapter_every=30), keep


def generated_pdfs(pages_wanted: int) -> None:
    print("| layout | pages | parse s | pages/s | words of the source in order | running header lines left |")
    print("|---|---|---|---|---|---|")
    for columns in (1, 2):
        rng = random.Random(columns)
        book, _ = book_of(filler_paragraphs(rng, pages_wanted * 8), pages_wanted, columns, columns)
        document, seconds = timed_parse(book.pdf, "book.pdf")
        pages = len(document.layout.pages)
        left = sum(document.text.count(header) for header in set(book.headers) if not header.isdigit())
        ratio = words_in_order(book.words, document.text.split())
        print(
            f"| {columns} column{'s' if columns > 1 else ''} | {pages} | {seconds:.2f} | {pages / seconds:.0f} | {ratio:.4f} | {left} |"
        )
    print()


def fact_book(facts: int, pages_wanted: int, seed: int) -> tuple[list[str], list[tuple[int, str, str, tuple[str, ...]]]]:
    """Filler paragraphs with `facts` invented facts, each its own paragraph at a spread place:
    (paragraphs, [(paragraph index, fact, question, accepted answers)])."""
    rng = random.Random(seed)
    _, keep = book_of(filler_paragraphs(random.Random(seed), pages_wanted * 8), pages_wanted, 2, seed)
    paragraphs = filler_paragraphs(rng, keep - facts)
    subjects = rng.sample([f"the {last} {thing}" for last in LAST for thing in THINGS], facts)
    placed = []
    for i, subject in enumerate(subjects):
        at = int((i + rng.uniform(0.1, 0.9)) / facts * len(paragraphs))
        fact, question, answers = draw(rng.choice(list(KINDS)), subject, rng)
        placed.append((at, fact, question, answers))
    for at, fact, *_ in sorted(placed, reverse=True):
        paragraphs.insert(at, fact)
    indexed = [(paragraphs.index(fact), fact, question, answers) for _, fact, question, answers in placed]
    return paragraphs, indexed


def through_rest(model: str, facts: int, pages_wanted: int, seed: int) -> None:
    paragraphs, placed = fact_book(facts, pages_wanted, seed)
    book = book_pdf(paragraphs, title="A Generated Chronicle", columns=2, seed=seed, chapter_every=30)
    text = "\n\n".join(paragraphs)
    print(f"a {book.pdf.count(b'/Type /Page ')}-page PDF, two columns; the same paragraphs as .txt")
    server = Server(["--model", model]).start()
    try:
        client = httpx.Client(base_url=server.url, timeout=600)
        rows = {}
        for label, body, media in (("pdf", book.pdf, "application/pdf"), ("txt", text.encode(), "text/plain")):
            session = client.post("/v1/sessions", json={"memory": "text"}).json()["id"]
            started = time.perf_counter()
            response = client.post(
                f"/v1/sessions/{session}/documents?name=chronicle.{label}", content=body, headers={"content-type": media}
            )
            ingest_seconds = time.perf_counter() - started
            assert response.status_code == 201, response.text
            document = response.json()
            extracted = client.get(f"/v1/sessions/{session}/documents/{document['id']}/text").text
            right = cited = holding = 0
            ttfts = []
            for index, fact, question, answers in placed:
                answer = client.post(f"/v1/sessions/{session}/ask", json={"question": question, "max_tokens": 48}).json()
                ttfts.append(answer["timings"]["ttft_seconds"])
                right += any(a.lower() in answer["answer"].lower() for a in answers)
                at = extracted.find(fact)
                items = [i for i in answer["retrieval"]["items"] if i["char_start"] <= at < i["char_end"]] if at >= 0 else []
                if items and label == "pdf":
                    holding += 1
                    page = book.page_of_paragraph[index] + 1
                    cited += items[0]["page_start"] <= page <= items[0]["page_end"]
            rows[label] = (document, ingest_seconds, right, cited, holding, statistics.median(ttfts))
        print(f"{len(placed)} facts on known pages, model {model}, text memory, answers of at most 48 tokens")
        print()
        print(
            "| posted as | pages | tokens | ingestion s | answers right | passage holding the fact cites its page | median TTFT s |"
        )
        print("|---|---|---|---|---|---|---|")
        for label, (document, seconds, right, cited, holding, ttft) in rows.items():
            pages = document["page_count"] or "–"
            cite = f"{cited}/{holding}" if label == "pdf" else "–"
            print(f"| {label} | {pages} | {document['tokens']:,} | {seconds:.1f} | {right}/{len(placed)} | {cite} | {ttft:.2f} |")
        print()
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--facts", type=int, default=20)
    parser.add_argument("--pages", type=int, default=300)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--skip-rest", action="store_true", help="parsing figures only")
    args = parser.parse_args()
    real_files()
    generated_pdfs(args.pages)
    if not args.skip_rest:
        through_rest(args.model, args.facts, args.pages, args.seed)


if __name__ == "__main__":
    main()
