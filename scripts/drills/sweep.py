"""Bad input: every case gets the status it deserves with a JSON error body, the server lives on,
and a document ingested before the sweep is untouched after it (same documents, same cache, same
greedy answer)."""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx
from pypdf import PdfWriter

from research.evals.docfiles import Line, Page, make_pdf, make_zip
from scripts.drills.server import Server

CHAT = "/v1/chat/completions"
JSON = {"content-type": "application/json"}


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str  # {s}: the reference session's id
    expect: tuple[int, ...]
    body: bytes | None = None
    headers: dict[str, str] | None = None


def chat(**fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}).encode()


def ask(**fields) -> bytes:
    return json.dumps({"question": "hi", "max_tokens": 2, **fields}).encode()


def cases(max_document_bytes: int) -> list[Case]:
    deep = b"[" * 100_000 + b"]" * 100_000
    return [
        Case("huge JSON body (8 MB)", "POST", "/v1/sessions", (413,), b'{"memory": "' + b"x" * 8_000_000 + b'"}', JSON),
        Case("deeply nested JSON (100k levels)", "POST", CHAT, (400, 413, 422), deep, JSON),
        Case("deeply nested options", "POST", "/v1/sessions", (400, 413, 422), b'{"options": {"a": ' + deep + b"}}", JSON),
        Case("JSON array for an object", "POST", "/v1/sessions", (422,), b"[]", JSON),
        Case("empty body", "POST", CHAT, (422,), b"", JSON),
        Case("not JSON", "POST", CHAT, (422,), b"{nope", JSON),
        Case("NUL bytes in a question", "POST", "/v1/sessions/{s}/ask", (200,), ask(question="a\u0000b"), JSON),
        Case("NUL bytes in a chat message", "POST", CHAT, (200,), chat(messages=[{"role": "user", "content": "\u0000"}]), JSON),
        Case("lone surrogate in chat", "POST", CHAT, (422,), b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', JSON),
        Case("lone surrogate in a question", "POST", "/v1/sessions/{s}/ask", (422,), b'{"question": "\\udfff"}', JSON),
        Case("lone surrogate in a document", "POST", "/v1/sessions/{s}/documents", (422,), b'{"text": "a \\ud800 b"}', JSON),
        Case(
            "non-UTF-8 text/plain upload",
            "POST",
            "/v1/sessions/{s}/documents",
            (415,),
            "café".encode("latin-1"),
            {"content-type": "text/plain"},
        ),
        Case(
            "unknown charset",
            "POST",
            "/v1/sessions/{s}/documents",
            (415,),
            b"abc",
            {"content-type": "text/plain; charset=x-nope"},
        ),
        Case(
            "non-UTF-8 multipart upload",
            "POST",
            "/v1/sessions/{s}/documents",
            (415,),
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.txt"\r\nContent-Type: text/plain\r\n\r\n\xff\xfe\xfa\r\n--b--\r\n',
            {"content-type": "multipart/form-data; boundary=b"},
        ),
        Case(
            "multipart without a file",
            "POST",
            "/v1/sessions/{s}/documents",
            (400,),
            b'--b\r\nContent-Disposition: form-data; name="name"\r\n\r\nx\r\n--b--\r\n',
            {"content-type": "multipart/form-data; boundary=b"},
        ),
        Case("XML document", "POST", "/v1/sessions/{s}/documents", (415,), b"<a/>", {"content-type": "application/xml"}),
        Case(
            "document over the byte limit",
            "POST",
            "/v1/sessions/{s}/documents",
            (413,),
            b"word " * (max_document_bytes // 5 + 1),
            {"content-type": "text/plain"},
        ),
        Case("empty document", "POST", "/v1/sessions/{s}/documents", (400,), b"   ", {"content-type": "text/plain"}),
        Case("max_tokens 10^12", "POST", CHAT, (422,), chat(max_tokens=10**12), JSON),
        Case("max_tokens over the server's bound", "POST", CHAT, (400,), chat(max_tokens=100_000), JSON),
        Case("max_tokens 0", "POST", "/v1/sessions/{s}/ask", (422,), ask(max_tokens=0), JSON),
        Case("temperature 1e308", "POST", CHAT, (422,), chat(temperature=1e308), JSON),
        Case("temperature 1e-300", "POST", CHAT, (200,), chat(temperature=1e-300), JSON),
        Case(
            "temperature NaN",
            "POST",
            CHAT,
            (422,),
            b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
            JSON,
        ),
        Case("top_p 1e-300", "POST", "/v1/sessions/{s}/ask", (200,), ask(temperature=1.0, top_p=1e-300), JSON),
        Case("top_p 0", "POST", CHAT, (422,), chat(top_p=0), JSON),
        Case("seed 2^64", "POST", CHAT, (422,), chat(seed=2**64), JSON),
        Case("seed as false", "POST", CHAT, (422,), chat(seed=False), JSON),
        Case("stream as 0", "POST", CHAT, (422,), chat(stream=0), JSON),
        Case("100 stop strings", "POST", CHAT, (422,), chat(stop=["x"] * 100), JSON),
        Case("empty messages", "POST", CHAT, (422,), b'{"messages": []}', JSON),
        Case("role tool", "POST", CHAT, (422,), b'{"messages": [{"role": "tool", "content": "x"}]}', JSON),
        Case(
            "last message not the user's",
            "POST",
            CHAT,
            (400,),
            b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}',
            JSON,
        ),
        Case(
            "prompt over the character limit",
            "POST",
            CHAT,
            (413,),
            chat(messages=[{"role": "user", "content": "w " * 200_000}]),
            JSON,
        ),
        Case("unknown memory", "POST", "/v1/sessions", (400,), b'{"memory": "quantum"}', JSON),
        Case("unknown option", "POST", "/v1/sessions", (400,), b'{"memory": "text", "options": {"warp": 9}}', JSON),
        Case("option of the wrong type", "POST", "/v1/sessions", (400,), b'{"memory": "text", "options": {"top_k": "x"}}', JSON),
        Case(
            "option 1.5 for an integer",
            "POST",
            "/v1/sessions",
            (400,),
            b'{"memory": "neurocache", "options": {"capacity": 1.5}}',
            JSON,
        ),
        Case(
            "neurocache capacity 4,000,000",
            "POST",
            "/v1/sessions",
            (413,),
            b'{"memory": "neurocache", "options": {"capacity": 4000000}}',
            JSON,
        ),
        Case("options not an object", "POST", "/v1/sessions", (422,), b'{"options": [1, 2]}', JSON),
        Case("unknown model", "POST", "/v1/sessions", (404,), b'{"model": "gpt-7"}', JSON),
        Case("path traversal id", "GET", "/v1/sessions/..%2F..%2Fetc%2Fpasswd", (404,)),
        Case("dot-dot id", "GET", "/v1/sessions/%2e%2e/documents", (404,)),
        Case("10,000-character id", "GET", "/v1/sessions/" + "s" * 10_000, (404,)),
        Case("traversal in a chat session_id", "POST", CHAT, (404, 422), chat(session_id="../../etc/passwd"), JSON),
        Case("unknown document", "GET", "/v1/sessions/{s}/documents/..%2F..", (404,)),
        Case("wrong method", "PUT", "/v1/sessions", (405,)),
        Case("unknown route", "GET", "/v1/nowhere", (404,)),
    ]


def file_cases() -> list[Case]:
    """Hostile and broken files (issue 63): each a JSON 4xx, nothing hangs, nothing else changes."""
    documents, pdf = "/v1/sessions/{s}/documents", {"content-type": "application/pdf"}
    raw = {"content-type": "application/octet-stream"}
    plain = make_pdf([Page([Line(72, 700, "a secret page")])])
    writer = PdfWriter(clone_from=io.BytesIO(plain))
    writer.encrypt(user_password="secret", owner_password="owner", algorithm="RC4-128")
    encrypted = io.BytesIO()
    writer.write(encrypted)
    pages = [Page([Line(72, 700, f"page {i} of many")]) for i in range(2_500)]
    depth = 150_000  # 1.65 MB, under the drills' document limit
    return [
        Case("encrypted PDF", "POST", documents, (422,), encrypted.getvalue(), pdf),
        Case("PDF without a text layer", "POST", documents, (422,), make_pdf([Page()], drawing=b"0 0 1 rg 9 9 99 99 re f"), pdf),
        Case("corrupt PDF", "POST", documents, (422,), b"%PDF-1.7\n" + bytes(range(256)) * 64, pdf),
        Case("truncated PDF", "POST", documents, (422,), plain[: len(plain) // 2], pdf),
        Case("PDF over the page limit (2,500 pages)", "POST", documents, (422,), make_pdf(pages), pdf),
        Case(
            "zip bomb as DOCX (past 256 MiB unpacked)",
            "POST",
            documents,
            (422,),
            make_zip({"word/document.xml": b" " * (257 << 20)}),
            raw,
        ),
        Case("EPUB without a container", "POST", documents, (422,), make_zip({"mimetype": b"application/epub+zip"}), raw),
        Case(
            "XML entities in a DOCX",
            "POST",
            documents,
            (422,),
            make_zip({"word/document.xml": b'<!DOCTYPE d [<!ENTITY a "a">]><d>&a;</d>'}),
            raw,
        ),
        Case("a zip that is no document", "POST", documents, (415,), make_zip({"a.txt": b"x"}), raw),
        # parsed in full, then refused for holding no text (so the reference session stays as it was)
        Case(
            "HTML nested 150,000 deep",
            "POST",
            documents,
            (400,),
            b"<div>" * depth + b"</div>" * depth,
            {"content-type": "text/html"},
        ),
        Case("an image", "POST", documents, (415,), b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, {"content-type": "image/png"}),
    ]


def fingerprint(client: httpx.Client, session_id: str) -> tuple:
    """What must not change: the session's documents, its cache, and a greedy answer."""
    info = client.get(f"/v1/sessions/{session_id}").json()
    answer = client.post(f"/v1/sessions/{session_id}/ask", json={"question": "Who did Alice follow?", "max_tokens": 12}).json()
    return info["documents"], info["cache"], answer["answer"]


def run_sweep(server: Server, max_document_bytes: int, reference_text: str) -> dict:
    client = httpx.Client(base_url=server.url, timeout=600)
    session_id = client.post("/v1/sessions", json={"memory": "text"}).json()["id"]
    client.post(f"/v1/sessions/{session_id}/documents", json={"text": reference_text, "name": "reference"})
    before = fingerprint(client, session_id)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for case in cases(max_document_bytes) + file_cases():
        response = client.request(
            case.method, server.url + case.path.replace("{s}", session_id), content=case.body, headers=case.headers
        )
        ok = response.status_code in case.expect
        if response.status_code >= 400:
            try:
                error = response.json()["error"]
                ok = ok and set(error) == {"type", "message"} and bool(error["message"])
            except (ValueError, KeyError, TypeError):
                ok = False
        rows.append({"case": case.name, "status": response.status_code, "expected": case.expect, "ok": ok})
    after = fingerprint(client, session_id)
    client.delete(f"/v1/sessions/{session_id}")
    return {
        "cases": len(rows),
        "failed": [row for row in rows if not row["ok"]],
        "server_errors": sum(row["status"] >= 500 for row in rows),
        "rows": rows,
        "reference_untouched": before == after,
        "alive": server.alive() and client.get("/readyz").status_code == 200,
        "seconds": round(time.perf_counter() - started, 1),
    }


def sweep_passed(result: dict) -> bool:
    return not result["failed"] and result["reference_untouched"] and result["alive"]
