"""Every error is JSON `{"error": {"type": ..., "message": ...}}` with the status it deserves."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from engine.errors import (
    ConflictError,
    DocumentError,
    InvalidRequestError,
    LongdocError,
    NotFoundError,
    NotReadyError,
    RetryLaterError,
    SnapshotUnreadableError,
    StorageError,
    TooLargeError,
    UnsupportedFormatError,
)

log = logging.getLogger(__name__)

STATUS_BY_ERROR: dict[type[LongdocError], int] = {
    InvalidRequestError: 400,
    DocumentError: 422,
    UnsupportedFormatError: 415,
    NotFoundError: 404,
    ConflictError: 409,
    SnapshotUnreadableError: 500,
    StorageError: 507,
    TooLargeError: 413,
    RetryLaterError: 429,
    NotReadyError: 503,
}


class ApiError(Exception):
    """An HTTP-only error (auth, media type, size before parsing)."""

    def __init__(self, status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.headers = status, kind, message, headers


def error_body(kind: str, message: str) -> dict[str, dict[str, str]]:
    return {"error": {"type": kind, "message": message}}


def status_of(exc: LongdocError) -> int:
    for cls in type(exc).__mro__:
        if cls in STATUS_BY_ERROR:
            return STATUS_BY_ERROR[cls]
    return 500


def json_error(app: Any, kind: str, message: str, status: int, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The error response, counted by type on `longdoc_errors_total`."""
    app.state.metrics.error(kind)
    return JSONResponse(error_body(kind, message), status_code=status, headers=headers)


def error_response(app: Any, exc: LongdocError) -> JSONResponse:
    headers = None
    if isinstance(exc, RetryLaterError):
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
    if isinstance(exc, NotReadyError):
        headers = {"Retry-After": "5"}
    return json_error(app, exc.kind, exc.message, status_of(exc), headers)


HTTP_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """Every method some route serves at the request's path, asked of the router itself."""
    return [
        method
        for method in HTTP_METHODS
        if any(route.matches({**scope, "method": method})[0] == Match.FULL for route in app.router.routes)
    ]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(LongdocError)
    async def _engine_error(request: Request, exc: LongdocError) -> JSONResponse:
        return error_response(request.app, exc)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return json_error(request.app, exc.kind, exc.message, exc.status, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()]
        return json_error(request.app, "validation_error", "; ".join(parts), 422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed", 408: "timeout", 413: "too_large"}.get(exc.status_code, "http_error")
        headers = exc.headers
        if exc.status_code == 405:  # Starlette names only the first matching route's methods
            headers = {**(headers or {}), "Allow": ", ".join(allowed_methods(app, request.scope))}
        return json_error(request.app, kind, str(exc.detail), exc.status_code, headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return json_error(request.app, "internal_error", "internal server error", 500)
