"""Every error is JSON `{"error": {"type": ..., "message": ...}}` with the status it deserves."""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from engine.errors import (
    ConflictError,
    SnapshotUnreadableError,
    StorageError,
    InvalidRequestError,
    LongdocError,
    NotFoundError,
    NotReadyError,
    RetryLaterError,
    TooLargeError,
)

log = logging.getLogger(__name__)

STATUS_BY_ERROR: dict[type[LongdocError], int] = {
    InvalidRequestError: 400,
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
            return STATUS_BY_ERROR[cls]  # type: ignore[index]
    return 500


def error_response(exc: LongdocError) -> JSONResponse:
    headers = None
    if isinstance(exc, RetryLaterError):
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
    if isinstance(exc, NotReadyError):
        headers = {"Retry-After": "5"}
    return JSONResponse(error_body(exc.kind, exc.message), status_code=status_of(exc), headers=headers)


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
        return error_response(exc)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc.kind, exc.message), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()]
        return JSONResponse(error_body("validation_error", "; ".join(parts)), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed", 408: "timeout", 413: "too_large"}.get(exc.status_code, "http_error")
        headers = exc.headers
        if exc.status_code == 405:  # Starlette names only the first matching route's methods
            headers = {**(headers or {}), "Allow": ", ".join(allowed_methods(app, request.scope))}
        return JSONResponse(error_body(kind, str(exc.detail)), status_code=exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal_error", "internal server error"), status_code=500)
