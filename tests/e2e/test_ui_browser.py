"""The web page in a real browser: Debian's Chromium, driven headless by Playwright, against a real
`longdoc serve` on SmolLM2-135M. A book is dropped on the page, a question is answered as it
streams, the passage behind it is highlighted in the document; Stop ends the generation on the
server; errors from JSON bodies and from `event: error` are shown; on a phone-width screen a
session is picked and a question asked from the keyboard. Screenshots of each step go to test-artifacts/ui/."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import httpx
import pytest
from playwright.sync_api import Page, Route, expect, sync_playwright

from engine.config import SMALL_MODEL
from research.evals.docfiles import book_pdf
from scripts.drills.server import Server
from tests.helpers import CACHE_DIR, FIXTURES

pytestmark = pytest.mark.slow

BOOK = FIXTURES / "alice29.txt"
QUESTION = "What were the names of the three little sisters in the Dormouse's story?"
SOURCE = "their names were Elsie, Lacie, and Tillie"  # the book's own words (spaces normalized), as the highlight must hold them
KEY = "ui-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ARTIFACTS = Path(os.environ.get("LONGDOC_TEST_ARTIFACTS", "test-artifacts")) / "ui"
# As the project's machines need it: no calls to Google's hosts (the network is closed); Playwright
# itself starts Chromium headless and without its sandbox (as root)
CHROMIUM_ARGS = [
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
    "--disable-gpu",
]
EXPECTED_401 = "status of 401"  # the first load, before the key is entered
LONG = 60_000  # ms: ingestion and answers on 2 CPU cores


def chromium() -> str:
    path = shutil.which("chromium")
    assert path, "Debian's chromium is missing: `make test` installs it (apt-get install chromium)"
    return path


class WatchedPage(Page):
    """A page as `open_page` leaves it; for the type checker only (pages are made by Playwright)."""

    errors: list[object]  # script errors and console errors
    book_session: str | None  # the `page` fixture's session, holding the book


@pytest.fixture(scope="module")
def server(default_dir, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("ui-server") / "server.log"
    env = {"LONGDOC_CACHE_DIR": str(CACHE_DIR), "LONGDOC_API_KEY": KEY}
    running = Server(["--model", SMALL_MODEL, "--default-memory", "text"], env=env, log=log).start()
    yield running
    assert running.process is not None
    running.process.terminate()
    running.process.wait(timeout=30)
    assert KEY not in log.read_text()


@pytest.fixture(scope="module")
def browser():
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        yield launched
        launched.close()


def open_page(browser, server: Server, width: int, height: int) -> WatchedPage:
    page = cast(WatchedPage, browser.new_page(viewport={"width": width, "height": height}))
    page.errors = []  # script errors and console errors (a script the policy blocked, say): none is expected

    def on_console(message) -> None:
        if message.type == "error" and EXPECTED_401 not in message.text:
            page.errors.append(message.text)

    page.on("pageerror", lambda error: page.errors.append(error))
    page.on("console", on_console)
    page.goto(f"{server.url}/")
    return page


@pytest.fixture(scope="module")
def page(browser, server):
    """The desktop page with the key entered once and a book uploaded into a new text session."""
    page = open_page(browser, server, 1400, 900)
    expect(page.locator("#error")).to_contain_text("unauthorized")  # no key yet: the server's 401, shown
    page.fill("#api-key", KEY)
    page.click("text=Use key")
    expect(page.locator("#model option")).not_to_have_count(0)
    new_session(page)
    page.set_input_files("#file", BOOK)
    expect(page.locator("#ingest-status")).to_contain_text("tokens in", timeout=LONG)
    page.book_session = session_id(page)
    page.screenshot(path=ARTIFACTS / "1-uploaded.png")
    yield page
    assert page.errors == []  # no script error on the page at any step
    page.close()


SELECTED = "#sessions .pick[aria-current=true]"


def session_id(page: Page) -> str | None:
    return page.get_attribute(SELECTED, "data-session") if page.locator(SELECTED).count() else None


def new_session(page: Page) -> str:
    """A new text session made on the page; its id once the page has selected it."""
    before = session_id(page)
    page.select_option("#memory", "text")
    page.click("text=New session")
    expect(page.locator(SELECTED)).to_have_count(1)
    if before is not None:
        expect(page.locator(SELECTED)).not_to_have_attribute("data-session", before)
    selected = session_id(page)
    assert selected is not None  # one is selected: expected above
    return selected


def normalized(text: str) -> str:
    return " ".join(text.split())


def ask(page: Page, question: str, max_tokens: int) -> None:
    page.fill("#question", question)
    page.fill("#max-tokens", str(max_tokens))
    page.click("#ask")


def test_upload_shows_the_document_and_its_session(page, server):
    sid = session_id(page)
    expect(page.locator("#ingest-progress")).to_have_attribute("value", "1")
    expect(page.locator("#documents")).to_contain_text("alice29.txt")
    expect(page.locator("#cache")).to_contain_text("entries")
    info = httpx.get(f"{server.url}/v1/sessions/{sid}", headers=AUTH).json()
    assert [d["name"] for d in info["documents"]] == ["alice29.txt"]
    assert f"{info['documents'][0]['tokens']} tokens" in page.inner_text("#documents")
    expect(page.locator("#viewer")).to_contain_text("Alice was beginning to get very tired")


def test_streamed_answer_with_its_passage_highlighted(page):
    ask(page, QUESTION, 48)
    expect(page.locator("#stop")).to_be_enabled()  # streaming
    expect(page.locator("#answer-status")).to_contain_text("Done", timeout=LONG)
    answer = page.inner_text("#answer")
    assert sum(name in answer for name in ("Elsie", "Lacie", "Tillie")) >= 2, answer
    assert page.locator("#passages li").count() >= 1
    expect(page.locator("#strategy")).to_have_text(re.compile(r"^\(chosen by: [a-z+]+\)$"))
    marks = page.locator("#viewer mark")
    marked = [normalized(text) for text in marks.all_text_contents()]
    assert any(SOURCE in text for text in marked), "no highlighted passage holds the answer's source"
    expect(page.locator("#viewer mark.current")).to_be_in_viewport()
    page.screenshot(path=ARTIFACTS / "2-answer.png")
    # each passage's button brings its own mark into view (and the focus there: the user asked)
    last = page.locator("#passages li button").last
    last.click()
    number = page.locator("#passages li").count()
    mark = page.locator(f"#viewer mark[data-passages~='{number}']")
    expect(mark).to_have_class("current")
    expect(mark).to_be_in_viewport()
    expect(mark).to_be_focused()


def test_a_second_question_marks_its_own_passages(page):
    ask(page, "What was written on the label of the little bottle Alice found?", 24)
    expect(page.locator("#answer-status")).to_contain_text("Done", timeout=LONG)
    excerpts = [normalized(t) for t in page.locator("#passages blockquote").all_text_contents()]
    marked = normalized(" ".join(page.locator("#viewer mark").all_text_contents()))
    assert excerpts and all(e[:100] in marked for e in excerpts)  # every passage is marked...
    numbers = {int(n) for m in page.locator("#viewer mark").all() for n in m.get_attribute("data-passages").split()}
    assert numbers == set(range(1, len(excerpts) + 1))  # ...and only these passages
    if not any(SOURCE in e for e in excerpts):
        assert SOURCE not in marked  # nothing left of the first answer's marks


def test_offsets_count_code_points_as_the_server_does(page):
    """The server's offsets are Python string indices (code points); an emoji is two UTF-16 units."""
    spans = page.evaluate(
        """async () => {
            const { markSpans } = await import("/ui/viewer.js");
            const text = "a\\u{1F600}bc def";
            const cut = markSpans([{ char_start: 2, char_end: 4 }, { char_start: 0, char_end: 6 }, { char_start: 3, char_end: 4 }], text);
            return cut.map((s) => [text.slice(s.start, s.end), s.numbers]);
        }"""
    )
    assert spans == [["a\U0001f600bc d", [2, 1, 3]]]


def ignore_eos(route: Route) -> None:
    """The page's ask request, sent on with `ignore_eos`: the answer runs to its max_tokens."""
    body = json.loads(route.request.post_data or "{}")
    route.continue_(post_data=json.dumps({**body, "ignore_eos": True}))


def test_stop_ends_the_generation_on_the_server(page, server):
    page.route("**/ask", ignore_eos)  # the model's own answer may end within a second
    try:
        ask(page, "Retell the whole book in great detail, chapter by chapter.", 1000)
        expect(page.locator("#answer")).not_to_be_empty(timeout=LONG)
        assert server.metric("longdoc_queue_depth") == 1  # the answer is being generated
        page.click("#stop")
        expect(page.locator("#answer-status")).to_have_text("Stopped.")
        stopped = time.monotonic()
        # 1000 tokens take about 20 s on this model on 2 cores; a stopped answer frees the worker at once
        while server.metric("longdoc_queue_depth") != 0:
            assert time.monotonic() - stopped < 10, "the server went on generating after Stop"
            time.sleep(0.2)
    finally:
        page.unroute("**/ask", ignore_eos)  # the module's later questions end as the model ends them
    page.screenshot(path=ARTIFACTS / "3-stopped.png")
    expect(page.locator("#ask")).to_be_enabled()


def drop_file(page: Page, selector: str, path: Path) -> None:
    """A file dragged from the desktop and dropped on `selector`, as the browser delivers it."""
    drop_bytes(page, selector, path.name, path.read_bytes(), "text/plain")


def drop_bytes(page: Page, selector: str, name: str, data: bytes, media_type: str) -> None:
    page.locator(selector).evaluate(
        """(target, [name, bytes, type]) => {
            const data = new DataTransfer();
            data.items.add(new File([new Uint8Array(bytes)], name, { type }));
            for (const type of ["dragover", "drop"]) target.dispatchEvent(new DragEvent(type, { dataTransfer: data, bubbles: true, cancelable: true }));
        }""",
        [name, list(data), media_type],
    )


def test_error_event_during_ingestion_is_shown(page, server):
    doomed = new_session(page)
    drop_file(page, "#drop", BOOK)
    expect(page.locator("#ingest-status")).to_have_text(re.compile(r"alice29.txt: \d+ of \d+ tokens"), timeout=LONG)
    assert httpx.delete(f"{server.url}/v1/sessions/{doomed}", headers=AUTH).status_code == 204
    # the upload's response started with 200 and progress events: the error can only come as an event
    expect(page.locator("#error")).to_have_text(
        re.compile(f"not_found: session {doomed} was deleted during ingestion"), timeout=LONG
    )
    page.screenshot(path=ARTIFACTS / "4-error-event.png")
    page.click("#error button")  # dismissed
    expect(page.locator("#error")).to_be_hidden()


def tab_to(page: Page, target, presses: int = 40) -> None:
    """Press Tab until `target` has the focus; fails if it never does."""
    for _ in range(presses):
        page.keyboard.press("Tab")
        if target.evaluate("element => element === document.activeElement"):
            return
    raise AssertionError(f"{target} cannot be reached with Tab")


def test_phone_width_and_keyboard(browser, server, page):
    phone = open_page(browser, server, 390, 844)
    keyboard = phone.keyboard
    phone.focus("#api-key")
    keyboard.type(KEY)
    keyboard.press("Enter")  # submits the key form
    expect(phone.locator("#sessions .pick")).not_to_have_count(0)
    phone.reload()  # the key stays for the tab (session storage)
    expect(phone.locator("#api-key")).to_have_value(KEY)
    expect(phone.locator("#sessions .pick")).not_to_have_count(0)
    # the book's session, picked with Tab and Enter; then Tab reaches the file field (the browser's
    # own control; its native chooser is not opened here: headless Chromium does so unreliably)
    target = phone.locator(f"#sessions .pick[data-session='{page.book_session}']")
    phone.focus("#new-session button")
    tab_to(phone, target)
    keyboard.press("Enter")
    expect(target).to_have_attribute("aria-current", "true")
    tab_to(phone, phone.locator("#file"))
    tab_to(phone, phone.locator("#question"))
    keyboard.type(QUESTION)
    keyboard.press("Control+Enter")
    expect(phone.locator("#answer-status")).to_contain_text("Done", timeout=LONG)
    assert "Elsie" in phone.inner_text("#answer")
    width = phone.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert width[0] <= width[1], f"the page scrolls sideways on a phone: {width}"
    phone.screenshot(path=ARTIFACTS / "5-phone.png", full_page=True)
    expect(phone.locator("#viewer-note")).to_contain_text("does not hold this document")  # its text is in the other page
    assert phone.errors == []
    phone.close()


def test_a_dropped_pdf_is_read_and_its_passages_cite_their_pages(page, server):
    paragraphs = [" ".join(p.split()) for p in BOOK.read_text(encoding="utf-8").split("\n\n") if len(p.split()) > 12][:80]
    book = book_pdf(paragraphs, title="Alice in Tests", columns=2, seed=4)
    sid = new_session(page)
    drop_bytes(page, "#drop", "alice.pdf", book.pdf, "application/pdf")
    expect(page.locator("#ingest-status")).to_contain_text("alice.pdf: ", timeout=LONG)
    expect(page.locator("#ingest-status")).to_contain_text("tokens in", timeout=LONG)
    info = httpx.get(f"{server.url}/v1/sessions/{sid}", headers=AUTH).json()
    assert [(d["name"], d["format"]) for d in info["documents"]] == [("alice.pdf", "pdf")]
    pages = info["documents"][0]["page_count"]
    expect(page.locator("#viewer .page-mark")).to_have_count(pages)  # the extracted text, its pages marked
    expect(page.locator("#viewer")).to_contain_text("Alice was beginning to get very tired")
    assert "%PDF" not in page.inner_text("#viewer")
    ask(page, "What did the Caterpillar ask Alice?", 8)
    expect(page.locator("#answer-status")).to_contain_text("Done", timeout=LONG)
    labels = page.locator("#passages li button").all_text_contents()
    assert labels and all(re.search(r"alice\.pdf \(pp?\. \d+", label) for label in labels), labels
    expect(page.locator("#viewer mark.current")).to_be_in_viewport()
    page.screenshot(path=ARTIFACTS / "6-pdf.png")
    assert page.errors == []
