"""Slow and oversized clients against a real uvicorn server (tiny model) over a raw socket."""

from __future__ import annotations

import socket
import time

import pytest

from scripts.drills.server import Server
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
