"""Documents in real formats through the API: PDF, EPUB, DOCX, HTML and Markdown bodies, the outline,
passages cited by page and section, and hostile files refused with a JSON 4xx, the session unchanged."""

from __future__ import annotations

import pytest

from research.evals.docfiles import Line, Page, book_pdf, make_docx, make_epub, make_pdf, make_zip
from tests.helpers import FIXTURES, assert_error, events_of, new_session

BOOK = (FIXTURES / "alice29.txt").read_text(encoding="utf-8")
PARAGRAPHS = [" ".join(p.split()) for p in BOOK.split("\n\n") if len(p.split()) > 12][:120]
PDF_TYPE = "application/pdf"


@pytest.fixture(scope="module")
def book():
    return book_pdf(PARAGRAPHS, title="Alice in Tests", columns=2, seed=3)


def test_a_pdf_body_is_parsed_with_its_pages_and_outline(shared_client, book):
    session_id = new_session(shared_client, memory="text")
    url = f"/v1/sessions/{session_id}/documents"
    response = shared_client.post(f"{url}?name=alice.pdf", content=book.pdf, headers={"content-type": PDF_TYPE})
    assert response.status_code == 201, response.text
    document = response.json()
    pages = book.pdf.count(b"/Type /Page ")
    assert document["name"] == "alice.pdf" and document["format"] == "pdf" and document["page_count"] == pages
    assert document["section_count"] == len(book.outline)
    detail = shared_client.get(f"{url}/{document['id']}").json()
    assert [(s["title"], s["page"]) for s in detail["outline"]] == [(t, p + 1) for t, p in book.outline]
    assert len(detail["pages"]) == pages and detail["pages"][0] == 0
    multipart = shared_client.post(url, files={"file": ("again.pdf", book.pdf, "application/octet-stream")})
    assert multipart.status_code == 201 and multipart.json()["format"] == "pdf"
    assert multipart.json()["chars"] == document["chars"]


def test_passages_cite_their_document_page_and_section(shared_client, book):
    session_id = new_session(shared_client, memory="text")
    url = f"/v1/sessions/{session_id}/documents"
    document = shared_client.post(f"{url}?name=alice.pdf", content=book.pdf, headers={"content-type": PDF_TYPE}).json()
    body = {"question": "What did the Caterpillar say to Alice about her size?", "max_tokens": 4, "stream": True}
    items = events_of(shared_client.post(f"/v1/sessions/{session_id}/ask", json=body))[0].data["items"]
    assert items
    detail = shared_client.get(f"{url}/{document['id']}").json()
    starts = detail["pages"]
    for item in items:
        assert item["document_name"] == "alice.pdf"
        page = sum(start <= item["char_start"] for start in starts)
        assert item["page_start"] == page and item["page_end"] >= page
        sections = [s for s in detail["outline"] if s["char_start"] <= item["char_start"]]
        assert item["section"] == (sections[-1]["title"] if sections else None)
    plain = shared_client.post(
        f"/v1/sessions/{session_id}/documents", content=BOOK[:2000], headers={"content-type": "text/plain"}
    )
    assert plain.json()["format"] == "text" and plain.json()["page_count"] == 0


def test_each_format_by_its_type_and_by_its_bytes(shared_client):
    session_id = new_session(shared_client, memory="text")
    url = f"/v1/sessions/{session_id}/documents"
    files = {
        "docx": (make_docx([("Heading1", "Findings"), ("", "Sales rose in May.")]), "application/octet-stream"),
        "epub": (make_epub("Book", [("One", ["It began."]), ("Two", ["It ended."])]), "application/epub+zip"),
        "html": (b"<html><nav>menu</nav><h1>Guide</h1><p>Run it.</p><script>x()</script></html>", "text/html"),
        "markdown": (b"# Notes\n\nA line.\n", "text/markdown"),
    }
    for format, (data, media) in files.items():
        response = shared_client.post(url, content=data, headers={"content-type": media})
        assert response.status_code == 201, (format, response.text)
        assert response.json()["format"] == format and response.json()["section_count"] >= 1
    html = shared_client.get(f"{url}/{shared_client.get(url).json()['data'][2]['id']}").json()
    assert html["chars"] == len("Guide\n\nRun it.") and html["outline"][0]["title"] == "Guide"


def _encrypted_mimetype() -> bytes:
    """A zip whose `mimetype` member is flagged encrypted: zipfile raises RuntimeError reading it."""
    data = bytearray(make_zip({"mimetype": b"application/epub+zip"}))
    for header in (b"PK\x03\x04", b"PK\x01\x02"):  # the general-purpose flags: bit 0, encrypted
        at = data.index(header)
        flags = at + (6 if header == b"PK\x03\x04" else 8)
        data[flags] |= 1
    return bytes(data)


def test_json_text_is_taken_as_written(shared_client):
    session_id = new_session(shared_client, memory="text")
    url = f"/v1/sessions/{session_id}/documents"
    for text in ("%PDF-1.7 is how every PDF starts.", "<!DOCTYPE html><p>markup, kept as text</p>"):
        response = shared_client.post(url, json={"text": text})
        assert response.status_code == 201 and response.json()["chars"] == len(text) and response.json()["format"] == "text"


def test_hostile_and_broken_files_get_a_json_4xx_and_change_nothing(make_client):
    client = make_client(max_unpacked_bytes=1 << 20, max_document_pages=50)
    session_id = new_session(client, memory="text")
    url = f"/v1/sessions/{session_id}/documents"
    assert client.post(url, json={"text": BOOK[:3000], "name": "kept"}).status_code == 201
    before = client.get(f"/v1/sessions/{session_id}").json()
    plain = make_pdf([Page([Line(72, 700, "one page")])])
    cases = [
        ("no text layer", make_pdf([Page()], drawing=b"0 0 1 rg 100 100 200 200 re f"), PDF_TYPE, 422),
        ("corrupt", b"%PDF-1.7 \x00\x01 not a pdf at all", PDF_TYPE, 422),
        ("truncated", plain[: len(plain) // 2], PDF_TYPE, 422),
        ("over the page limit", make_pdf([Page([Line(72, 700, f"p{i}")]) for i in range(51)]), PDF_TYPE, 422),
        ("zip bomb", make_zip({"word/document.xml": b"<d>" + b" " * (8 << 20) + b"</d>"}), "application/octet-stream", 422),
        (
            "entities",
            make_zip({"word/document.xml": b'<!DOCTYPE d [<!ENTITY a "a">]><d>&a;</d>'}),
            "application/octet-stream",
            422,
        ),
        ("encrypted zip member", _encrypted_mimetype(), "application/octet-stream", 422),
        ("zip of neither", make_zip({"a.txt": b"x"}), "application/zip", 415),
        ("declared pdf", b"just text", PDF_TYPE, 422),
        ("unknown type", b"\x00\x01", "image/png", 415),
        ("bad epub", make_zip({"mimetype": b"application/epub+zip"}), "application/epub+zip", 422),
    ]
    for name, data, media, status in cases:
        response = client.post(url, content=data, headers={"content-type": media})
        assert response.status_code == status, (name, response.text)
        assert_error(response, status)
    multipart = client.post(url, files={"file": ("x.pdf", b"%PDF-1.4 broken", PDF_TYPE)})
    assert_error(multipart, 422, "invalid_document")
    assert client.get(f"/v1/sessions/{session_id}").json()["documents"] == before["documents"]
    assert client.get("/healthz").status_code == 200


def test_a_question_can_keep_to_some_documents(make_client):
    client = make_client()
    session_id = new_session(client, memory="text")
    url = f"/v1/sessions/{session_id}/documents"
    first = client.post(f"{url}?name=one.txt", content=BOOK[:6000], headers={"content-type": "text/plain"}).json()["id"]
    second = client.post(f"{url}?name=two.txt", content=BOOK[6000:12000], headers={"content-type": "text/plain"}).json()["id"]
    ask = f"/v1/sessions/{session_id}/ask"
    body = {"question": "What did Alice see?", "max_tokens": 2}
    for chosen in ([first], [second], [first, second]):
        items = client.post(ask, json=body | {"documents": chosen}).json()["retrieval"]["items"]
        assert items and {i["document_id"] for i in items} <= set(chosen)
        assert {i["document_name"] for i in items} <= {"one.txt", "two.txt"}
    chat = {"messages": [{"role": "user", "content": "What did Alice see?"}], "max_tokens": 2, "session_id": session_id}
    assert client.post("/v1/chat/completions", json=chat | {"documents": [second]}).status_code == 200
    assert_error(client.post(ask, json=body | {"documents": ["d-nope"]}), 404, "not_found")
    assert_error(client.post(ask, json=body | {"documents": []}), 422)
    assert_error(client.post("/v1/chat/completions", json=chat | {"session_id": None, "documents": [first]}), 400)
    window = new_session(client, memory="truncate")
    doc = client.post(f"/v1/sessions/{window}/documents", json={"text": BOOK[:3000]}).json()["id"]
    assert_error(client.post(f"/v1/sessions/{window}/ask", json=body | {"documents": [doc]}), 400, "invalid_request")
