"""Dependencies read from `app.state`: the engine, settings, metrics, and the API-key check."""

from __future__ import annotations

from typing import Annotated, cast

from fastapi import Depends, Request

from engine.errors import NotFoundError
from engine.interface import EngineClient, SessionInfo
from server.auth import Caller, KeyRing
from server.errors import ApiError
from server.metrics import Metrics
from server.settings import Settings


def get_engine(request: Request) -> EngineClient:
    return cast(EngineClient, request.app.state.engine)


def get_settings(request: Request) -> Settings:
    return cast(Settings, request.app.state.settings)


def get_metrics(request: Request) -> Metrics:
    return cast(Metrics, request.app.state.metrics)


def require_api_key(request: Request) -> Caller | None:
    """With API keys configured, /v1 needs `Authorization: Bearer <key>`; returns who called
    (None: no keys configured, everyone sees everything)."""
    keys: KeyRing = request.app.state.keys
    if not keys.enabled:
        return None
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    caller = keys.identify(token.strip()) if scheme.lower() == "bearer" else None
    if caller is None:
        raise ApiError(401, "unauthorized", "missing or wrong API key", {"WWW-Authenticate": "Bearer"})
    return caller


def visible_session(engine: EngineClient, session_id: str, caller: Caller | None) -> SessionInfo:
    """The session, if this caller may see it; 404 otherwise, as for a session that does not exist."""
    info = engine.get_session(session_id)
    if caller is not None and not caller.may_see(info.owner):
        raise NotFoundError(f"no session {session_id!r}")
    return info


EngineDep = Annotated[EngineClient, Depends(get_engine)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
CallerDep = Annotated[Caller | None, Depends(require_api_key)]
