"""OpenAI-compatible `/v1/chat/completions` and `/v1/models`; `session_id` picks a session's memory."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi.sse import EventSourceResponse

from engine.interface import GenerationDone, GenerationEvent, TokenDelta
from server.deps import CallerDep, EngineDep, MetricsDep, SettingsDep, visible_session
from server.metrics import GenerationTimer, Metrics
from server.routes.ask import generation_params, observe, usage_of
from server.schemas import ChatCompletionRequest, ModelCard, ModelList
from server.streaming import event_stream, sse

router = APIRouter(prefix="/v1", tags=["openai"])

ENDPOINT = "chat_completions"


@router.get("/models")
async def list_models(engine: EngineDep, settings: SettingsDep) -> ModelList:
    created = int(time.time())
    cards = [
        ModelCard(
            id=m.name,
            created=created,
            context_length=m.context_len,
            architecture=m.architecture,
            memories=list(m.memories),
            dtype=m.dtype,
            quantize=m.quantize,
        )
        for m in engine.list_models()
    ]
    return ModelList(data=cards)


def _chunk(base: dict[str, Any], delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}


@router.post("/chat/completions", response_model=None)  # None: the return annotation is no response model
async def chat_completions(
    body: ChatCompletionRequest, engine: EngineDep, settings: SettingsDep, metrics: MetricsDep, caller: CallerDep
) -> EventSourceResponse | dict[str, Any]:
    session = visible_session(engine, body.session_id, caller) if body.session_id else None
    timer = GenerationTimer(metrics, ENDPOINT)
    defaults = engine.generation_defaults(body.model or (session.model if session else None))
    params = generation_params(body, body.max_completion_tokens or body.max_tokens or settings.default_max_tokens, defaults)
    messages = [m.model_dump() for m in body.messages]
    events = await engine.chat(messages, params, body.model, body.session_id, body.documents)
    model = body.model or (session.model if session else engine.list_models()[0].name)
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return event_stream(_chunks(events, base, include_usage, metrics, timer), events, metrics)
    text: list[str] = []
    async with contextlib.aclosing(events):
        async for event in events:
            observe(metrics, event, timer)
            if isinstance(event, TokenDelta):
                text.append(event.text)
            elif isinstance(event, GenerationDone):
                done = event
    timer.finish(done.prompt_tokens, done.completion_tokens)
    return {
        **base,
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "".join(text)}, "finish_reason": done.finish_reason}
        ],
        "usage": usage_of(done).model_dump(),
    }


async def _chunks(
    events: AsyncIterator[GenerationEvent],
    base: dict[str, Any],
    include_usage: bool,
    metrics: Metrics,
    timer: GenerationTimer,
) -> AsyncGenerator[bytes, None]:
    base = {**base, "object": "chat.completion.chunk"}
    yield sse(_chunk(base, {"role": "assistant", "content": ""}, None))
    async for event in events:
        observe(metrics, event, timer)
        if isinstance(event, TokenDelta):
            yield sse(_chunk(base, {"content": event.text}, None))
        elif isinstance(event, GenerationDone):
            timer.finish(event.prompt_tokens, event.completion_tokens)
            yield sse(_chunk(base, {}, event.finish_reason))
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage_of(event).model_dump()})
    yield sse("[DONE]")
