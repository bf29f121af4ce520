"""Sync and async clients over httpx, with server-sent events read by httpx-sse.

Every endpoint is written once, in `_Endpoints`, as the request it makes; `LongdocClient` sends
them blocking and `AsyncLongdocClient` awaiting, with the same method names. A request answered
429 (queue full, memory budget) or 503 (loading) is sent again after the server's `Retry-After`,
up to `retries` times: the server refuses those before doing any work, so a retry repeats nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx
from httpx_sse import EventSource, ServerSentEvent

DEFAULT_URL = "http://127.0.0.1:8000"
RETRY_STATUSES = frozenset({429, 503})
MAX_RETRY_WAIT = 60.0  # seconds; a longer Retry-After is cut to this


@dataclass(frozen=True)
class Event:
    """One server-sent event: its name (`progress`, `retrieval`, `delta`, `done`, `error`) and JSON data."""

    event: str
    data: Any


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(f"{status} {kind}: {message}")
        self.status, self.kind, self.message = status, kind, message


@dataclass(frozen=True)
class Call:
    """One request: what `_Endpoints` describes and the two clients send."""

    method: str
    path: str
    json: Any = None
    pick: str | None = None  # a field of the JSON answer to return instead of the whole


def _raise_for_error(status: int, body: bytes) -> None:
    if status < 400:
        return
    try:
        error = json.loads(body)["error"]
        raise ApiError(status, error["type"], error["message"])
    except (ValueError, KeyError, TypeError):
        raise ApiError(status, "http_error", body.decode(errors="replace")[:500]) from None


def _result(call: Call, response: httpx.Response) -> Any:
    _raise_for_error(response.status_code, response.content)
    body: Any = response.json() if response.content else None
    return body[call.pick] if call.pick else body


def to_event(sse: ServerSentEvent) -> Event:
    return Event(sse.event, sse.data if sse.data == "[DONE]" else json.loads(sse.data))


def events_of(response: httpx.Response) -> Iterator[Event]:
    """The events of a response, read as they arrive (tests use it on in-process responses too)."""
    return (to_event(sse) for sse in EventSource(response).iter_sse())


def retry_wait(response: httpx.Response, attempt: int) -> float:
    """Seconds to wait before sending a refused request again: Retry-After, else a doubling backoff."""
    try:
        wait = float(response.headers["retry-after"])
    except (KeyError, ValueError):
        wait = 0.5 * 2**attempt
    return min(max(wait, 0.0), MAX_RETRY_WAIT)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _without_none(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


Result = TypeVar("Result")  # Any (sync) or Awaitable[Any] (async)
Stream = TypeVar("Stream")  # Iterator[Event] (sync) or AsyncIterator[Event] (async)


class _Endpoints(ABC, Generic[Result, Stream]):
    """The API, once. `_send` and `_stream` are the client's own: blocking or awaiting."""

    @abstractmethod
    def _send(self, call: Call) -> Result: ...

    @abstractmethod
    def _stream(self, call: Call) -> Stream: ...

    def models(self) -> Result:
        return self._send(Call("GET", "/v1/models", pick="data"))

    def create_session(
        self, model: str | None = None, memory: str | None = None, options: dict[str, Any] | None = None
    ) -> Result:
        return self._send(Call("POST", "/v1/sessions", json={"model": model, "memory": memory, "options": options or {}}))

    def sessions(self) -> Result:
        return self._send(Call("GET", "/v1/sessions", pick="data"))

    def session(self, session_id: str) -> Result:
        return self._send(Call("GET", f"/v1/sessions/{session_id}"))

    def delete_session(self, session_id: str) -> Result:
        return self._send(Call("DELETE", f"/v1/sessions/{session_id}"))

    def add_document(self, session_id: str, text: str, name: str | None = None) -> Result:
        return self._send(Call("POST", f"/v1/sessions/{session_id}/documents", json={"text": text, "name": name}))

    def add_document_stream(self, session_id: str, text: str, name: str | None = None) -> Stream:
        body = {"text": text, "name": name, "stream": True}
        return self._stream(Call("POST", f"/v1/sessions/{session_id}/documents", json=body))

    def ask(self, session_id: str, question: str, **params: Any) -> Result:
        body = {"question": question, "stream": False, **_without_none(params)}
        return self._send(Call("POST", f"/v1/sessions/{session_id}/ask", json=body))

    def ask_stream(self, session_id: str, question: str, **params: Any) -> Stream:
        body = {"question": question, "stream": True, **_without_none(params)}
        return self._stream(Call("POST", f"/v1/sessions/{session_id}/ask", json=body))

    def cache(self, session_id: str) -> Result:
        return self._send(Call("GET", f"/v1/sessions/{session_id}/cache"))

    def clear_cache(self, session_id: str) -> Result:
        return self._send(Call("DELETE", f"/v1/sessions/{session_id}/cache"))


class LongdocClient(_Endpoints[Any, Iterator[Event]]):
    """Blocking client. `transport` (an httpx keyword) lets tests talk to an in-process app."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        api_key: str | None = None,
        timeout: float = 900.0,
        retries: int = 3,
        **httpx_kwargs: Any,
    ) -> None:
        self._http = httpx.Client(base_url=base_url, headers=_headers(api_key), timeout=timeout, **httpx_kwargs)
        self.retries = retries

    def close(self) -> None:
        self._http.close()

    def _open(self, call: Call) -> httpx.Response:
        """The response with its body unread, after retrying refusals."""
        for attempt in range(self.retries + 1):
            request = self._http.build_request(call.method, call.path, json=call.json)
            response = self._http.send(request, stream=True)
            if response.status_code not in RETRY_STATUSES or attempt == self.retries:
                return response
            response.close()
            time.sleep(retry_wait(response, attempt))
        raise AssertionError("unreachable")

    def _send(self, call: Call) -> Any:
        response = self._open(call)
        try:
            response.read()
        finally:
            response.close()
        return _result(call, response)

    def _stream(self, call: Call) -> Iterator[Event]:
        response = self._open(call)
        try:
            if response.status_code >= 400:
                _raise_for_error(response.status_code, response.read())
            yield from events_of(response)
        finally:
            response.close()


class AsyncLongdocClient(_Endpoints[Awaitable[Any], AsyncIterator[Event]]):
    """Asynchronous client: the same methods, awaited (streams are async iterators)."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        api_key: str | None = None,
        timeout: float = 900.0,
        retries: int = 3,
        **httpx_kwargs: Any,
    ) -> None:
        self._http = httpx.AsyncClient(base_url=base_url, headers=_headers(api_key), timeout=timeout, **httpx_kwargs)
        self.retries = retries

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _open(self, call: Call) -> httpx.Response:
        for attempt in range(self.retries + 1):
            request = self._http.build_request(call.method, call.path, json=call.json)
            response = await self._http.send(request, stream=True)
            if response.status_code not in RETRY_STATUSES or attempt == self.retries:
                return response
            await response.aclose()
            await asyncio.sleep(retry_wait(response, attempt))
        raise AssertionError("unreachable")

    async def _send(self, call: Call) -> Any:  # the coroutine is the Awaitable
        response = await self._open(call)
        try:
            await response.aread()
        finally:
            await response.aclose()
        return _result(call, response)

    async def _stream(self, call: Call) -> AsyncIterator[Event]:
        response = await self._open(call)
        try:
            if response.status_code >= 400:
                _raise_for_error(response.status_code, await response.aread())
            async for sse in EventSource(response).aiter_sse():
                yield to_event(sse)
        finally:
            await response.aclose()
