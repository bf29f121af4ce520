"""Slow and oversized clients against a real uvicorn server (tiny model) over a raw socket."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from scripts.drills.server import Server
from scripts.drills.streams import decode_while_all
from tests.helpers import CACHE_DIR


@pytest.fixture(scope="module")
def server(tiny_dir):
    args = [
        "--model",
        str(tiny_dir),
        "--dtype",
        "float32",
        "--cache-dir",
        str(CACHE_DIR),
        "--body-read-timeout-seconds",
        "1",
        "--max-request-bytes",
        "100000",
        "--max-document-bytes",
        "1000000",
    ]
    server = Server(args).start(timeout=120)
    yield server.port
    server.stop()


def exchange(port: int, head: bytes, body_parts: list[bytes], pause: float = 0.0) -> str:
    """Send a request in parts with a pause before each body part; the response's text."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        for part in body_parts:
            time.sleep(pause)
            try:
                sock.sendall(part)
            except OSError:
                break  # the server answered and closed already
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


def test_a_stalled_body_gets_408(server):
    head = (
        b"POST /v1/sessions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 20\r\nconnection: close\r\n\r\n{"
    )
    started = time.monotonic()
    response = exchange(server, head, [b'"memory": "text"}'], pause=3.0)
    assert response.startswith("HTTP/1.1 408") and '"type":"timeout"' in response
    assert time.monotonic() - started < 3.0 + 5.0


def test_a_declared_huge_body_is_refused_unread(server):
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 50000000\r\nconnection: close\r\n\r\n"
    )
    response = exchange(server, head, [])
    assert response.startswith("HTTP/1.1 413") and "LONGDOC_MAX_REQUEST_BYTES" in response


def sent_whole(port: int, head: bytes, body: bytes) -> str:
    """Send the whole body, then read the response; a reset connection fails the test."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        sock.sendall(body)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.parametrize(
    ("path", "media", "size", "status"),
    [
        ("/v1/chat/completions", b"application/json", 10_000_000, "413"),  # over max_request_bytes
        ("/v1/sessions/{s}/documents", b"text/plain", 5_000_000, "413"),  # over max_document_bytes
        ("/v1/sessions/s-nope/documents", b"text/plain", 5_000_000, "404"),  # refused before its body is read
    ],
)
def test_a_refused_body_is_read_so_the_error_reaches_the_client(server, path, media, size, status):
    session = httpx.post(f"http://127.0.0.1:{server}/v1/sessions", json={"memory": "text"}).json()["id"]
    head = b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
    response = sent_whole(server, head % (path.replace("{s}", session).encode(), media, size), b"w" * size)
    assert response.startswith(f"HTTP/1.1 {status}") and '{"error":{"type":' in response


def test_a_chunked_body_cut_off_at_the_limit_still_gets_its_413(server):
    head = b"POST /v1/sessions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    chunk = b"x" * 65536
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(40)) + b"0\r\n\r\n"  # 2.6 MB
    response = sent_whole(server, head, body)
    assert response.startswith("HTTP/1.1 413") and "LONGDOC_MAX_REQUEST_BYTES" in response


def test_a_client_waiting_for_100_continue_is_refused_at_once(server):
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 50000000\r\nexpect: 100-continue\r\nconnection: close\r\n\r\n"
    )
    started = time.monotonic()
    response = exchange(server, head, [])
    assert response.startswith("HTTP/1.1 413") and time.monotonic() - started < 1.0  # no wait for a body never sent


def test_a_page_file_is_sent_without_waiting_for_a_body(server):
    """A GET has no body to linger over; the static files' response reads the connection itself,
    so a wait for the rest of a body would hold each file for the read timeout (1 s here)."""
    with httpx.Client(base_url=f"http://127.0.0.1:{server}") as client:
        client.get("/ui/app.js")  # the connection opened
        for name in ("", "app.js", "style.css", "favicon.svg"):
            started = time.monotonic()
            response = client.get(f"/ui/{name}")
            assert response.status_code == 200 and time.monotonic() - started < 0.8, name


def test_a_page_file_asked_with_a_body_is_sent_at_once(server):
    """The file's response reads the body itself while it sends: no wait for a drain."""
    head = b"GET /ui/app.js HTTP/1.1\r\nhost: x\r\ncontent-type: text/plain\r\ncontent-length: 5\r\nconnection: close\r\n\r\n"
    started = time.monotonic()
    response = sent_whole(server, head, b"hello")
    assert response.startswith("HTTP/1.1 200") and time.monotonic() - started < 0.8


def test_decode_while_all_counts_only_the_window_where_every_stream_decodes():
    """The drills' and bench/peers.py's aggregate: tokens inside the window from the last first
    delta to the first last delta, each stream by its share of deltas there."""
    assert decode_while_all([([0.0, 1.0, 2.0, 3.0], 4), ([1.0, 2.0, 3.0, 4.0], 4)]) == 2.0
    assert decode_while_all([([0.0, 1.0], 2), ([2.0, 3.0], 2)]) is None  # never all at once
