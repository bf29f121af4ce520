"""Request body limits enforced before a body is read whole, and refusals that reach the client.

JSON bodies are held to `max_request_bytes`: a declared Content-Length over it is refused, and a
body sent without one is cut off as soon as it passes the limit. Document uploads are left to their
route, which has a limit of its own (`max_document_bytes`). Every body, uploads too, must keep
arriving: a client that sends nothing for `read_timeout` seconds gets 408.

A response sent before its request's body was read (413, 401, 415, 404...) would leave the
client's bytes unread; closing the socket then resets the connection (TCP sends RST over unread
data), and a client still sending sees ECONNRESET instead of the JSON error. So the rest of the
body is read and dropped first, up to `linger_bytes` (a lingering close, as nginx and Apache do),
unless the client waits for "100 Continue" before sending it. As nginx's lingering close, it gives
up when the client pauses for LINGER_READ_SECONDS or after LINGER_SECONDS in all.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import json_error

DOCUMENT_UPLOAD = re.compile(r"^/v1/sessions/[^/]+/documents/?$")
LINGER_READ_SECONDS = 5.0  # at most; the body read timeout when that is shorter
LINGER_SECONDS = 30.0


def _too_large(limit: int) -> str:
    return f"the request body is over the limit of {limit} bytes (LONGDOC_MAX_REQUEST_BYTES)"


@dataclass
class BodyState:
    received: int = 0
    done: bool = False  # the last body message arrived (or the client left)
    waits_for_continue: bool = False  # "Expect: 100-continue": nothing is sent until the app reads
    reading: bool = False  # the app waits on receive() itself (a file or stream listening for a disconnect)


class RequestBodyLimit:
    def __init__(self, app: ASGIApp, *, limit: int, read_timeout: float, linger_bytes: int) -> None:
        self.app, self.limit, self.read_timeout, self.linger_bytes = app, limit, read_timeout, linger_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = None if DOCUMENT_UPLOAD.match(scope["path"]) else self.limit
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        state = BodyState(waits_for_continue=headers.get(b"expect", b"").lower() == b"100-continue")
        # In HTTP/1.x a request without Transfer-Encoding whose Content-Length is absent or zero has
        # no body: nothing to read before the response (HTTP/2 may send a body without either)
        empty = declared == b"" or (declared.isdigit() and int(declared) == 0)
        state.done = scope.get("http_version") in ("1.0", "1.1") and empty and b"transfer-encoding" not in headers
        if limit is not None and declared.isdigit() and int(declared) > limit:
            await self.drain(receive, state, int(declared))
            response = json_error(scope["app"], "too_large", _too_large(limit), 413)
            await response(scope, receive, send)
            return

        async def guarded() -> Message:
            if state.done:  # after the body, receive() waits for a disconnect: no timeout there
                return await receive()
            state.reading = True
            try:
                message = await self._next(receive, self.read_timeout)
            finally:
                state.reading = False
            if message is None:
                state.done = True  # stalled: nothing to linger over
                # FastAPI passes HTTPException through body parsing to the error handlers
                raise HTTPException(408, f"no request body bytes for {self.read_timeout:g} s (LONGDOC_BODY_READ_TIMEOUT_SECONDS)")
            self._count(message, state)
            if limit is not None and state.received > limit:
                raise HTTPException(413, _too_large(limit))
            return message

        async def send_after_body(message: Message) -> None:
            # a response that reads receive() beside its sending (Starlette's FileResponse and
            # StreamingResponse under ASGI 2.3) takes the body's messages itself: a drain would wait
            # for one that never comes
            if message["type"] == "http.response.start" and not state.done and not state.reading:
                await self.drain(receive, state, int(declared) if declared.isdigit() else None)
            await send(message)

        await self.app(scope, guarded, send_after_body)

    @staticmethod
    async def _next(receive: Receive, timeout: float) -> Message | None:
        """The next message, or None when none came for `timeout` seconds."""
        try:
            return await asyncio.wait_for(receive(), timeout)
        except TimeoutError:
            return None

    @staticmethod
    def _count(message: Message, state: BodyState) -> None:
        if message["type"] == "http.request":
            state.received += len(message.get("body", b""))
            state.done = not message.get("more_body", False)
        else:  # http.disconnect
            state.done = True

    async def drain(self, receive: Receive, state: BodyState, declared: int | None) -> None:
        """Read and drop what is left of the body, up to `linger_bytes` in all, while it keeps coming."""
        if state.waits_for_continue and not state.received:
            return  # the client sends nothing until told to continue, and will not be
        if declared is not None and declared > self.linger_bytes:
            return  # too much to read: the client may see a reset
        deadline = time.monotonic() + LINGER_SECONDS
        pause = min(self.read_timeout, LINGER_READ_SECONDS)
        while not state.done and state.received <= self.linger_bytes:
            left = deadline - time.monotonic()
            message = await self._next(receive, min(pause, left)) if left > 0 else None
            if message is None:
                return
            self._count(message, state)
