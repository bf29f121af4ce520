"""Request body limits enforced before a body is read whole.

JSON bodies are held to `max_request_bytes`: a declared Content-Length over it is refused at once,
and a body sent without one is cut off as soon as it passes the limit. Document uploads are left
to their route, which has a limit of its own (`max_document_bytes`).
"""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import error_body

DOCUMENT_UPLOAD = re.compile(r"^/v1/sessions/[^/]+/documents/?$")


def _too_large(limit: int) -> str:
    return f"the request body is over the limit of {limit} bytes (LONGDOC_MAX_REQUEST_BYTES)"


class RequestBodyLimit:
    def __init__(self, app: ASGIApp, *, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or DOCUMENT_UPLOAD.match(scope["path"]):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            response = JSONResponse(error_body("too_large", _too_large(self.limit)), status_code=413)
            await response(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise HTTPException(413, _too_large(self.limit))  # FastAPI passes HTTPException through body parsing
            return message

        await self.app(scope, limited, send)
