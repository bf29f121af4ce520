"""Run one HTTP request, received by the ingress, through the app in this process: the response
comes out as a `ResponseStart` and then its body chunks, as the app sends them (streams stay
streams). When the consumer stops early (the client went away), the app is told so, as a server
would tell it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message

log = logging.getLogger(__name__)

STOP_GRACE_SECONDS = 5.0  # how long an app that was told of the disconnect has to finish
QUEUED_MESSAGES = 64  # what the app may send ahead of the consumer before its send() waits


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


def scope_of(request: ForwardedRequest) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "root_path": "",
        "query_string": request.query_string,
        "headers": request.headers,
        "client": request.client,
        "server": None,
    }


async def run_asgi(
    app: ASGIApp, request: ForwardedRequest, extra_headers: list[tuple[bytes, bytes]]
) -> AsyncGenerator[Any, None]:
    """Yield the response's `ResponseStart` (with `extra_headers` added), then its body chunks."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue(QUEUED_MESSAGES)
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(scope_of(request), receive, send)
        finally:
            await sent.put(None)

    task = asyncio.create_task(run())
    ended = False  # the app's task has put its last message
    started = False
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                started = True
                yield ResponseStart(message["status"], [*message.get("headers", []), *extra_headers])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        else:  # the app's end (None) came before the end of its body
            ended = True
        if not started:  # the app raised before answering: what its server would say
            yield ResponseStart(500, [(b"content-type", b"application/json"), *extra_headers])
            yield b'{"error": {"type": "internal_error", "message": "internal server error"}}'
    finally:
        disconnected.set()
        try:
            if not ended:
                await _drain(sent)
        finally:  # even when the caller is cancelled while draining
            await _stop(task, request)


async def _drain(sent: asyncio.Queue[Message | None]) -> None:
    """Take what an app told of the disconnect still sends (a full queue would hold it), until it ends."""

    async def until_end() -> None:
        while await sent.get() is not None:
            pass

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(until_end(), STOP_GRACE_SECONDS)


async def _stop(task: asyncio.Task[None], request: ForwardedRequest) -> None:
    """Cancel an app that has not ended, wait for it, log one that failed."""
    if not task.done():
        task.cancel()
    await asyncio.wait([task], timeout=STOP_GRACE_SECONDS)
    if task.done() and not task.cancelled() and task.exception() is not None:
        log.error("request %s %s failed", request.method, request.path, exc_info=task.exception())
