"""Document upload: JSON `{"text", "name"}`, a multipart file, or the file as the body (text, Markdown,
HTML, PDF, EPUB or DOCX: engine/documents/ reads each)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import asdict

from fastapi import APIRouter, Query, Request
from fastapi.sse import EventSourceResponse
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from engine.documents.detect import ACCEPTED
from engine.errors import InvalidRequestError, TooLargeError
from engine.interface import IngestDone, IngestEvent, IngestProgress, Upload
from server.deps import CallerDep, EngineDep, MetricsDep, SettingsDep, visible_session
from server.errors import ApiError
from server.metrics import IngestionMeter
from server.schemas import DocumentCreate, DocumentPublic
from server.streaming import event_stream, sse

router = APIRouter(prefix="/v1/sessions", tags=["documents"])

MULTIPART_SLACK = 64 * 1024  # form boundaries and headers around the file
FILE_TYPES = [media for media in ACCEPTED if media != "text/plain"]  # a file sent as the body, besides text


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


def media_of(content_type: str) -> tuple[str, str | None]:
    """The media type of a Content-Type header and its charset parameter (None when there is none)."""
    media, *params = content_type.split(";")
    charset = None
    for param in params:
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset" and value.strip():
            charset = value.strip().strip('"')
    return media.strip().lower(), charset


async def _from_multipart(request: Request, body: bytes) -> tuple[Upload, str | None, bool]:
    async def replay() -> dict[str, object]:
        return {"type": "http.request", "body": body, "more_body": False}

    form = await Request(request.scope, replay).form(max_files=1, max_fields=8, max_part_size=len(body) + 1)
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise InvalidRequestError("multipart uploads need a file field named 'file'")
    media, charset = media_of(upload.content_type or "")
    name = form.get("name") or upload.filename
    stream = str(form.get("stream", "false")).lower() in ("1", "true", "yes")
    return Upload(await upload.read(), media, upload.filename, charset), str(name) if name else None, stream


def _from_json(body: bytes) -> tuple[str, str | None, bool]:
    try:
        document = DocumentCreate.model_validate_json(body)
    except ValidationError as exc:
        raise ApiError(422, "validation_error", "; ".join(e["msg"] for e in exc.errors())) from exc
    return document.text, document.name, document.stream


async def read_upload(request: Request, limit: int) -> tuple[Upload | str, str | None, bool]:
    """(upload, name, stream) from whichever body the client sent: JSON text (taken as plain text,
    as it is), a multipart file, or the file itself as the body (its format from its Content-Type,
    ?name= and its bytes)."""
    media, charset = media_of(request.headers.get("content-type", ""))
    if not media:
        raise ApiError(
            415, "unsupported_media_type", "send a Content-Type: application/json, multipart/form-data or the file's type"
        )
    body = await read_body(request, limit + (MULTIPART_SLACK if media in ("application/json", "multipart/form-data") else 0))
    if media == "application/json":
        return _from_json(body)
    if media == "multipart/form-data":
        return await _from_multipart(request, body)
    name = request.query_params.get("name")
    return Upload(body, media, name, charset), name, False


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
            **{media: {"schema": {"type": "string", "format": "binary"}} for media in FILE_TYPES},
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
    name: str | None = Query(None, max_length=256, description="the document's name, for a file sent as the body"),
) -> EventSourceResponse | DocumentPublic:
    memory = visible_session(engine, session_id, caller).memory
    upload, given_name, stream_body = await read_upload(request, settings.max_document_bytes)
    parsed = upload if isinstance(upload, str) else await engine.parse(upload)
    text = parsed if isinstance(parsed, str) else parsed.text
    if len(text.encode()) > settings.max_document_bytes:
        raise TooLargeError(f"the document's text is over the limit of {settings.max_document_bytes} bytes")
    events = await engine.ingest(session_id, parsed, given_name or name or "document")
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
