"""Request body limits enforced before a body is read whole.

JSON bodies are held to `max_request_bytes`: a declared Content-Length over it is refused at once,
and a body sent without one is cut off as soon as it passes the limit. Document uploads are left
to their route, which has a limit of its own (`max_document_bytes`). Every body, uploads too, must
keep arriving: a client that sends nothing for `read_timeout` seconds gets 408.
"""

from __future__ import annotations

import asyncio
import re

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import json_error

DOCUMENT_UPLOAD = re.compile(r"^/v1/sessions/[^/]+/documents/?$")


def _too_large(limit: int) -> str:
    return f"the request body is over the limit of {limit} bytes (LONGDOC_MAX_REQUEST_BYTES)"


class RequestBodyLimit:
    def __init__(self, app: ASGIApp, *, limit: int, read_timeout: float) -> None:
        self.app, self.limit, self.read_timeout = app, limit, read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = None if DOCUMENT_UPLOAD.match(scope["path"]) else self.limit
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if limit is not None and declared.isdigit() and int(declared) > limit:
            response = json_error(scope["app"], "too_large", _too_large(limit), 413)
            await response(scope, receive, send)
            return
        received, body_done = 0, False

        async def guarded() -> Message:
            nonlocal received, body_done
            if body_done:  # after the body, receive() waits for a disconnect: no timeout there
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout)
            except TimeoutError:
                # FastAPI passes HTTPException through body parsing to the error handlers
                raise HTTPException(
                    408, f"no request body bytes for {self.read_timeout:g} s (LONGDOC_BODY_READ_TIMEOUT_SECONDS)"
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if limit is not None and received > limit:
                    raise HTTPException(413, _too_large(limit))
            return message

        await self.app(scope, guarded, send)
