"""The FastAPI application: lifespan loads the engine in the background; routers do HTTP only."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Depends, FastAPI, Request, Response

from engine.interface import EngineClient
from server.deps import require_api_key
from server.errors import install_error_handlers
from server.limits import RequestBodyLimit
from server.metrics import Metrics
from server.routes import ask, documents, health, openai, sessions, ui
from server.settings import Settings

log = logging.getLogger(__name__)

EngineFactory = Callable[[Settings], EngineClient]

API_DESCRIPTION = """Ask questions about documents far longer than the model's context.

Errors are JSON `{"error": {"type", "message"}}` with a 4xx status (5xx only for faults of the
server). A streamed response (`"stream": true`, server-sent events) has already sent `200` when an
error can still happen; such an error arrives as the stream's last event:

    event: error
    data: {"error": {"type": "memory_budget_exceeded", "message": "..."}}

and the stream ends. The `type` is the one the same error would have had as a status response.
"""


def default_engine(settings: Settings) -> EngineClient:
    from engine.engine import Engine  # the only place the server reaches for the engine's implementation

    return Engine(settings.engine_config())


async def _load(app: FastAPI) -> None:
    try:
        await app.state.engine.start()
        log.info("ready: %s", ", ".join(m.name for m in app.state.engine.list_models()))
    except Exception as exc:  # noqa: BLE001 - reported by /readyz
        app.state.load_error = f"{type(exc).__name__}: {exc}"
        log.exception("model loading failed")


def route_template(request: Request) -> str:
    """The matched route's path template (never the raw path: it holds session ids)."""
    return getattr(request.scope.get("route"), "path", "unmatched")


def create_app(settings: Settings | None = None, engine_factory: EngineFactory = default_engine) -> FastAPI:
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.engine = engine_factory(settings)
        app.state.load_error = None
        loading = asyncio.create_task(_load(app))
        try:
            yield
        finally:
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loading
            await app.state.engine.stop()

    app = FastAPI(title="longdoc", version="0.1.0", description=API_DESCRIPTION, lifespan=lifespan)
    app.state.settings = settings
    app.state.keys = settings.key_ring()
    app.state.metrics = Metrics(lambda: app.state.engine.stats() if hasattr(app.state, "engine") else None)
    install_error_handlers(app)
    app.add_middleware(
        RequestBodyLimit,
        limit=settings.max_request_bytes,
        read_timeout=settings.body_read_timeout_seconds,
        linger_bytes=settings.linger_bytes,
    )
    app.include_router(health.router)
    app.include_router(ui.router)
    app.mount("/ui", ui.page_files(), name="ui")
    for router in (sessions.router, documents.router, ask.router, openai.router):
        app.include_router(router, dependencies=[Depends(require_api_key)])

    @app.middleware("http")
    async def count_requests(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        try:
            response = await call_next(request)
        except Exception:  # answered 500 by the catch-all handler, outside this middleware
            app.state.metrics.requests.labels(route_template(request), request.method, "500").inc()
            raise
        app.state.metrics.requests.labels(route_template(request), request.method, str(response.status_code)).inc()
        return response

    return app
