"""The client library against scripted HTTP answers: retries on 429/503 after Retry-After, errors,
and server-sent events, the same through the blocking and the async client."""

from __future__ import annotations

import httpx
import pytest

from clients.client import MAX_RETRY_WAIT, ApiError, AsyncLongdocClient, Event, LongdocClient, retry_wait

SSE = b'event: delta\ndata: {"text":"hi"}\n\nevent: done\ndata: {"n":1}\n\ndata: [DONE]\n\n'
EXPECTED_EVENTS = [Event("delta", {"text": "hi"}), Event("done", {"n": 1}), Event("message", "[DONE]")]


def scripted(*answers: httpx.Response) -> tuple[httpx.MockTransport, list[httpx.Request]]:
    """A transport giving `answers` in order, and the requests it saw."""
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answers[len(seen) - 1]

    return httpx.MockTransport(handle), seen


def refused(status: int, after: str | None = "0") -> httpx.Response:
    headers = {"Retry-After": after} if after is not None else {}
    return httpx.Response(status, json={"error": {"type": "queue_full", "message": "busy"}}, headers=headers)


def test_a_refused_request_is_sent_again_until_it_is_answered():
    transport, seen = scripted(refused(429), refused(503), httpx.Response(200, json={"data": [{"id": "m"}]}))
    assert LongdocClient("http://x", transport=transport).models() == [{"id": "m"}]
    assert len(seen) == 3 and all(r.url.path == "/v1/models" for r in seen)


def test_retries_run_out_into_the_servers_error():
    transport, seen = scripted(refused(429), refused(429))
    with pytest.raises(ApiError) as error:
        LongdocClient("http://x", transport=transport, retries=1).ask("s", "q")
    assert (error.value.status, error.value.kind, len(seen)) == (429, "queue_full", 2)
    assert seen[0].content == seen[1].content  # the same request again


def test_other_errors_are_not_retried():
    transport, seen = scripted(httpx.Response(404, json={"error": {"type": "not_found", "message": "no session"}}))
    with pytest.raises(ApiError, match="404 not_found: no session"):
        LongdocClient("http://x", transport=transport).session("s")
    assert len(seen) == 1


def test_streams_retry_then_yield_events():
    sse = {"content-type": "text/event-stream"}
    transport, seen = scripted(refused(503), httpx.Response(200, content=SSE, headers=sse))
    assert list(LongdocClient("http://x", transport=transport).ask_stream("s", "q", max_tokens=None)) == EXPECTED_EVENTS
    assert len(seen) == 2 and b'"stream":true' in seen[1].content and b"max_tokens" not in seen[1].content


async def test_the_async_client_makes_the_same_requests():
    sse = {"content-type": "text/event-stream"}
    transport, seen = scripted(
        refused(429), httpx.Response(201, json={"id": "s1"}), httpx.Response(200, content=SSE, headers=sse)
    )
    client = AsyncLongdocClient("http://x", transport=transport)
    try:
        assert await client.create_session(memory="text") == {"id": "s1"}
        assert [event async for event in client.add_document_stream("s1", "text")] == EXPECTED_EVENTS
    finally:
        await client.aclose()
    assert [(r.method, r.url.path) for r in seen] == [
        ("POST", "/v1/sessions"),
        ("POST", "/v1/sessions"),
        ("POST", "/v1/sessions/s1/documents"),
    ]


def test_retry_wait_follows_retry_after_within_a_cap():
    assert retry_wait(refused(429, "3"), 0) == 3.0
    assert retry_wait(refused(429, "86400"), 0) == MAX_RETRY_WAIT
    assert [retry_wait(refused(503, None), attempt) for attempt in range(3)] == [0.5, 1.0, 2.0]
