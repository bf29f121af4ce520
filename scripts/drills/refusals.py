"""Refusals that reach the client (issue 62): bodies over their limit (a 10 MB question to /ask and
to chat completions, a 50 MB document, each fully sent) get the 413 JSON, not a reset connection,
and the server's RSS grows by at most twice the largest body while it reads and drops them."""

from __future__ import annotations

import json
import socket

import httpx

from scripts.drills.server import Server

BODIES = (
    ("ask, 10 MB question", "/v1/sessions/{s}/ask", 10_000_000, "application/json"),
    ("chat, 10 MB message", "/v1/chat/completions", 10_000_000, "application/json"),
    ("document, 50 MB", "/v1/sessions/{s}/documents", 50_000_000, "text/plain"),
)


def _body(size: int, media: str) -> bytes:
    if media == "text/plain":
        return b"word " * (size // 5)
    text = "word " * (size // 5)
    if size == 10_000_000 and media == "application/json":
        return json.dumps({"question": text, "messages": [{"role": "user", "content": text}]}).encode()
    return text.encode()


def _post_whole(port: int, path: str, body: bytes, media: str) -> tuple[int | None, str]:
    """(status, body) of a POST whose whole body is sent before the response is read, as a simple
    client does; (None, the error) when the connection is reset."""
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: {media}\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
            sock.sendall(head.encode() + body)
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
    except OSError as exc:
        return None, type(exc).__name__
    response = b"".join(chunks).decode("utf-8", "replace")
    return int(response.split(" ", 2)[1]), response.split("\r\n\r\n", 1)[-1]


def run_refusals(server: Server) -> dict:
    client = httpx.Client(base_url=server.url, timeout=120)
    session = client.post("/v1/sessions", json={"memory": "text"}).json()["id"]
    rss_before = server.rss_bytes()
    rows: list[dict] = []
    for name, path, size, media in BODIES:
        body = _body(size, media)
        status, text = _post_whole(server.port, path.replace("{s}", session), body, media)
        rows.append(
            {"case": name, "status": status, "json": text.startswith('{"error"'), "reset": status is None, "bytes": len(body)}
        )
    growth = server.rss_bytes() - rss_before
    client.delete(f"/v1/sessions/{session}")
    largest = max(size for _, _, size, _ in BODIES)
    return {
        "rows": rows,
        "all_413_json": all(row["status"] == 413 and row["json"] for row in rows),
        "rss_growth_mib": round(growth / 2**20, 1),
        "rss_growth_over_largest_body": round(growth / largest, 2),
        "alive": server.alive(),
    }


def refusals_passed(result: dict) -> bool:
    return result["all_413_json"] and result["rss_growth_over_largest_body"] <= 2.0 and result["alive"]
