"""Document upload: JSON `{"text", "name"}`, a multipart file, or a text/plain body."""

from __future__ import annotations

import codecs
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import asdict

from fastapi import APIRouter, Query, Request
from fastapi.sse import EventSourceResponse
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from engine.errors import InvalidRequestError, TooLargeError
from engine.interface import IngestDone, IngestEvent, IngestProgress
from server.deps import CallerDep, EngineDep, MetricsDep, SettingsDep, visible_session
from server.errors import ApiError
from server.metrics import IngestionMeter
from server.schemas import DocumentCreate, DocumentPublic
from server.streaming import event_stream, sse

router = APIRouter(prefix="/v1/sessions", tags=["documents"])

MULTIPART_SLACK = 64 * 1024  # form boundaries and headers around the file


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise TooLargeError(f"the request body is {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLargeError(f"the request body passed the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def charset_of(content_type: str) -> str:
    """The charset parameter of a Content-Type header; UTF-8 when there is none."""
    for param in content_type.split(";")[1:]:
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset" and value.strip():
            return value.strip().strip('"')
    return "utf-8"


def decode_text(data: bytes, charset: str = "utf-8") -> str:
    try:
        codec = codecs.lookup(charset).name
    except LookupError:
        raise ApiError(415, "unsupported_media_type", f"unknown charset {charset!r}") from None
    if codec == "utf-8":
        codec = "utf-8-sig"  # drop a byte-order mark
    try:
        return data.decode(codec)
    except UnicodeDecodeError as exc:
        raise ApiError(415, "unsupported_media_type", f"the document is not valid {charset} text ({exc.reason})") from exc


async def _from_multipart(request: Request, body: bytes) -> tuple[str, str | None, bool]:
    async def replay() -> dict[str, object]:
        return {"type": "http.request", "body": body, "more_body": False}

    form = await Request(request.scope, replay).form(max_files=1, max_fields=8, max_part_size=len(body) + 1)
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise InvalidRequestError("multipart uploads need a file field named 'file'")
    text = decode_text(await upload.read(), charset_of(upload.content_type or ""))
    name = form.get("name") or upload.filename
    stream = str(form.get("stream", "false")).lower() in ("1", "true", "yes")
    return text, str(name) if name else None, stream


def _from_json(body: bytes) -> tuple[str, str | None, bool]:
    try:
        document = DocumentCreate.model_validate_json(body)
    except ValidationError as exc:
        raise ApiError(422, "validation_error", "; ".join(e["msg"] for e in exc.errors())) from exc
    return document.text, document.name, document.stream


async def parse_document(request: Request, limit: int) -> tuple[str, str | None, bool]:
    """(text, name, stream) from whichever body the client sent."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media not in ("application/json", "multipart/form-data", "text/plain"):
        raise ApiError(415, "unsupported_media_type", "send application/json, multipart/form-data or text/plain")
    body = await read_body(request, limit + (MULTIPART_SLACK if media != "text/plain" else 0))
    if media == "application/json":
        text, name, stream = _from_json(body)
    elif media == "multipart/form-data":
        text, name, stream = await _from_multipart(request, body)
    else:
        text, name, stream = decode_text(body, charset_of(request.headers.get("content-type", ""))), None, False
    if len(text.encode()) > limit:
        raise TooLargeError(f"the document is over the limit of {limit} bytes")
    return text, name, stream


DOCUMENT_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": DocumentCreate.model_json_schema()},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "name": {"type": "string"},
                        "stream": {"type": "boolean"},
                    },
                }
            },
            "text/plain": {"schema": {"type": "string", "minLength": 1}},
        },
    }
}


@router.post("/{session_id}/documents", status_code=201, response_model=DocumentPublic, openapi_extra=DOCUMENT_BODY)
async def add_document(
    session_id: str,
    request: Request,
    engine: EngineDep,
    settings: SettingsDep,
    metrics: MetricsDep,
    caller: CallerDep,
    stream: bool = Query(False, description="stream ingestion progress as server-sent events"),
) -> EventSourceResponse | DocumentPublic:
    text, name, stream_body = await parse_document(request, settings.max_document_bytes)
    memory = visible_session(engine, session_id, caller).memory
    events = await engine.ingest(session_id, text, name or "document")
    meter = IngestionMeter(metrics, memory)
    if stream or stream_body:
        return event_stream(_progress_events(events, meter), events, metrics)
    done: IngestDone | None = None
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                meter.on_event(event)
                if isinstance(event, IngestDone):
                    done = event
    finally:
        meter.close()
    assert done is not None
    return DocumentPublic.model_validate(asdict(done.document))


async def _progress_events(events: AsyncIterator[IngestEvent], meter: IngestionMeter) -> AsyncGenerator[bytes, None]:
    try:
        async for event in events:
            meter.on_event(event)
            if isinstance(event, IngestProgress):
                yield sse(asdict(event), event="progress")
            else:
                yield sse(asdict(event.document), event="done")
    finally:
        meter.close()
