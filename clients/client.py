"""Typed sync and async clients over httpx, with streaming iterators for server-sent events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


@dataclass(frozen=True)
class Event:
    """One server-sent event: its name (`progress`, `retrieval`, `delta`, `done`, `error`) and JSON data."""

    event: str
    data: Any


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(f"{status} {kind}: {message}")
        self.status, self.kind, self.message = status, kind, message


def _raise_for_error(status: int, body: bytes) -> None:
    if status < 400:
        return
    try:
        error = json.loads(body)["error"]
        raise ApiError(status, error["type"], error["message"])
    except (ValueError, KeyError, TypeError):
        raise ApiError(status, "http_error", body.decode(errors="replace")[:500]) from None


class _SseParser:
    """Incremental parser of the SSE wire format (lines in, events out)."""

    def __init__(self) -> None:
        self._event, self._data = "message", []

    def feed(self, line: str) -> Event | None:
        if line == "":
            if not self._data:
                return None
            raw = "\n".join(self._data)
            event = Event(self._event, json.loads(raw) if raw != "[DONE]" else raw)
            self._event, self._data = "message", []
            return event
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            self._event = value
        elif field == "data":
            self._data.append(value)
        return None


def parse_sse(lines: Iterable[str]) -> Iterator[Event]:
    parser = _SseParser()
    for line in lines:
        if (event := parser.feed(line)) is not None:
            yield event


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _ask_body(question: str, stream: bool, params: dict[str, Any]) -> dict[str, Any]:
    return {"question": question, "stream": stream, **{k: v for k, v in params.items() if v is not None}}


def _session_body(model: str | None, memory: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
    return {"model": model, "memory": memory, "options": options or {}}


class LongdocClient:
    """Blocking client. `transport` lets tests talk to an in-process app."""

    def __init__(
        self, base_url: str = DEFAULT_URL, api_key: str | None = None, timeout: float = 900.0, **httpx_kwargs: Any
    ) -> None:
        self._http = httpx.Client(base_url=base_url, headers=_headers(api_key), timeout=timeout, **httpx_kwargs)

    def close(self) -> None:
        self._http.close()

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._http.request(method, path, **kwargs)
        _raise_for_error(response.status_code, response.content)
        return response.json() if response.content else None

    def _events(self, path: str, **kwargs: Any) -> Iterator[Event]:
        with self._http.stream("POST", path, **kwargs) as response:
            if response.status_code >= 400:
                _raise_for_error(response.status_code, response.read())
            yield from parse_sse(response.iter_lines())

    def models(self) -> list[dict[str, Any]]:
        return self._json("GET", "/v1/models")["data"]

    def create_session(
        self, model: str | None = None, memory: str | None = None, options: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return self._json("POST", "/v1/sessions", json=_session_body(model, memory, options))

    def sessions(self) -> list[dict[str, Any]]:
        return self._json("GET", "/v1/sessions")["data"]

    def session(self, session_id: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/sessions/{session_id}")

    def delete_session(self, session_id: str) -> None:
        self._json("DELETE", f"/v1/sessions/{session_id}")

    def add_document(self, session_id: str, text: str, name: str | None = None) -> dict[str, Any]:
        return self._json("POST", f"/v1/sessions/{session_id}/documents", json={"text": text, "name": name})

    def add_document_stream(self, session_id: str, text: str, name: str | None = None) -> Iterator[Event]:
        body = {"text": text, "name": name, "stream": True}
        return self._events(f"/v1/sessions/{session_id}/documents", json=body)

    def ask(self, session_id: str, question: str, **params: Any) -> dict[str, Any]:
        return self._json("POST", f"/v1/sessions/{session_id}/ask", json=_ask_body(question, False, params))

    def ask_stream(self, session_id: str, question: str, **params: Any) -> Iterator[Event]:
        return self._events(f"/v1/sessions/{session_id}/ask", json=_ask_body(question, True, params))

    def cache(self, session_id: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/sessions/{session_id}/cache")

    def clear_cache(self, session_id: str) -> dict[str, Any]:
        return self._json("DELETE", f"/v1/sessions/{session_id}/cache")


class AsyncLongdocClient:
    """Asynchronous client with the same methods as `LongdocClient`."""

    def __init__(
        self, base_url: str = DEFAULT_URL, api_key: str | None = None, timeout: float = 900.0, **httpx_kwargs: Any
    ) -> None:
        self._http = httpx.AsyncClient(base_url=base_url, headers=_headers(api_key), timeout=timeout, **httpx_kwargs)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = await self._http.request(method, path, **kwargs)
        _raise_for_error(response.status_code, response.content)
        return response.json() if response.content else None

    async def _events(self, path: str, **kwargs: Any) -> AsyncIterator[Event]:
        async with self._http.stream("POST", path, **kwargs) as response:
            if response.status_code >= 400:
                _raise_for_error(response.status_code, await response.aread())
            parser = _SseParser()
            async for line in response.aiter_lines():
                if (event := parser.feed(line)) is not None:
                    yield event

    async def models(self) -> list[dict[str, Any]]:
        return (await self._json("GET", "/v1/models"))["data"]

    async def create_session(
        self, model: str | None = None, memory: str | None = None, options: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return await self._json("POST", "/v1/sessions", json=_session_body(model, memory, options))

    async def sessions(self) -> list[dict[str, Any]]:
        return (await self._json("GET", "/v1/sessions"))["data"]

    async def session(self, session_id: str) -> dict[str, Any]:
        return await self._json("GET", f"/v1/sessions/{session_id}")

    async def delete_session(self, session_id: str) -> None:
        await self._json("DELETE", f"/v1/sessions/{session_id}")

    async def add_document(self, session_id: str, text: str, name: str | None = None) -> dict[str, Any]:
        return await self._json("POST", f"/v1/sessions/{session_id}/documents", json={"text": text, "name": name})

    def add_document_stream(self, session_id: str, text: str, name: str | None = None) -> AsyncIterator[Event]:
        body = {"text": text, "name": name, "stream": True}
        return self._events(f"/v1/sessions/{session_id}/documents", json=body)

    async def ask(self, session_id: str, question: str, **params: Any) -> dict[str, Any]:
        return await self._json("POST", f"/v1/sessions/{session_id}/ask", json=_ask_body(question, False, params))

    def ask_stream(self, session_id: str, question: str, **params: Any) -> AsyncIterator[Event]:
        return self._events(f"/v1/sessions/{session_id}/ask", json=_ask_body(question, True, params))

    async def cache(self, session_id: str) -> dict[str, Any]:
        return await self._json("GET", f"/v1/sessions/{session_id}/cache")

    async def clear_cache(self, session_id: str) -> dict[str, Any]:
        return await self._json("DELETE", f"/v1/sessions/{session_id}/cache")
