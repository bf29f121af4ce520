"""Dependencies read from `app.state`: the engine, settings, metrics, and the API-key check."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request

from engine.interface import EngineClient
from server.errors import ApiError
from server.metrics import Metrics
from server.settings import Settings


def get_engine(request: Request) -> EngineClient:
    return request.app.state.engine


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


def require_api_key(request: Request) -> None:
    """When an API key is configured, /v1 needs `Authorization: Bearer <key>`."""
    key = request.app.state.settings.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.get_secret_value().encode()):
        raise ApiError(401, "unauthorized", "missing or wrong API key", {"WWW-Authenticate": "Bearer"})


EngineDep = Annotated[EngineClient, Depends(get_engine)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
