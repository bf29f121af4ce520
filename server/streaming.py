"""Server-sent events on top of FastAPI's own SSE support, and event-to-JSON helpers."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi.sse import EventSourceResponse, format_sse_event

from engine.errors import LongdocError
from engine.interface import EventIterator
from server.errors import error_body
from server.metrics import Metrics

log = logging.getLogger(__name__)


def sse(data: Any, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return format_sse_event(data_str=payload, event=event)


def error_event(exc: BaseException, metrics: Metrics) -> bytes:
    """Errors after the stream started can only travel as an `error` event (counted like any other)."""
    if isinstance(exc, LongdocError):
        kind, message = exc.kind, exc.message
    else:
        log.exception("internal error while streaming", exc_info=exc)
        kind, message = "internal_error", "internal server error"
    metrics.error(kind)
    return sse(error_body(kind, message), event="error")


def event_stream(chunks: AsyncGenerator[bytes, None], upstream: EventIterator[object], metrics: Metrics) -> EventSourceResponse:
    """Send `chunks` as SSE; `upstream` (an engine stream) is closed however the response ends,
    so a client that disconnects cancels the work behind it."""

    async def body() -> AsyncIterator[bytes]:
        async with contextlib.aclosing(upstream), contextlib.aclosing(chunks):
            try:
                async for chunk in chunks:
                    yield chunk
            except Exception as exc:  # noqa: BLE001 - reported to the client as an event
                yield error_event(exc, metrics)

    return EventSourceResponse(body(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
