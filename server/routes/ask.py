"""Questions about a session's documents, answered as JSON or streamed as server-sent events."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import asdict

from fastapi import APIRouter
from fastapi.sse import EventSourceResponse

from engine.interface import GenerationDone, GenerationEvent, GenerationParams, Retrieval, TokenDelta
from server.deps import CallerDep, EngineDep, MetricsDep, SettingsDep, visible_session
from server.metrics import GenerationTimer, Metrics
from server.schemas import AskRequest, AskResponse, ChatCompletionRequest, RetrievalPublic, Timings, Usage
from server.streaming import event_stream, sse

router = APIRouter(prefix="/v1/sessions", tags=["ask"])

ENDPOINT = "ask"


def stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def generation_params(
    body: AskRequest | ChatCompletionRequest, max_tokens: int, defaults: dict[str, float] | None = None
) -> GenerationParams:
    """The sampling fields both request bodies share, as the engine takes them; a field an OpenAI
    request leaves out is the model's default (`defaults`, from its manifest), else OpenAI's, 1."""
    defaults = defaults or {}
    return GenerationParams(
        max_tokens=max_tokens,
        temperature=body.temperature if body.temperature is not None else defaults.get("temperature", 1.0),
        top_p=body.top_p if body.top_p is not None else defaults.get("top_p", 1.0),
        seed=body.seed,
        stop=stop_tuple(body.stop),
        no_repeat_ngram_size=body.no_repeat_ngram_size,
        repetition_penalty=body.repetition_penalty,
        ignore_eos=body.ignore_eos,
    )


def usage_of(done: GenerationDone) -> Usage:
    return Usage(
        prompt_tokens=done.prompt_tokens,
        completion_tokens=done.completion_tokens,
        total_tokens=done.prompt_tokens + done.completion_tokens,
    )


def observe(metrics: Metrics, event: GenerationEvent, timer: GenerationTimer) -> None:
    """Record what one engine event tells the metrics."""
    if isinstance(event, Retrieval):
        metrics.retrieval.labels(event.memory).observe(event.seconds)
    elif isinstance(event, TokenDelta):
        timer.on_text()


def timings(timer: GenerationTimer, done: GenerationDone, retrieval: Retrieval | None) -> Timings:
    total = timer.finish(done.prompt_tokens, done.completion_tokens)
    return Timings(ttft_seconds=timer.ttft, total_seconds=total, retrieval_seconds=retrieval.seconds if retrieval else None)


@router.post("/{session_id}/ask", response_model=AskResponse)
async def ask(
    session_id: str, body: AskRequest, engine: EngineDep, settings: SettingsDep, metrics: MetricsDep, caller: CallerDep
) -> EventSourceResponse | AskResponse:
    visible_session(engine, session_id, caller)
    timer = GenerationTimer(metrics, ENDPOINT)
    params = generation_params(body, body.max_tokens or settings.default_max_tokens)
    events = await engine.ask(session_id, body.question, params, body.documents)
    if body.stream:
        return event_stream(_ask_events(events, metrics, timer), events, metrics)
    answer: list[str] = []
    retrieval: Retrieval | None = None
    async with contextlib.aclosing(events):
        async for event in events:
            observe(metrics, event, timer)
            if isinstance(event, Retrieval):
                retrieval = event
            elif isinstance(event, TokenDelta):
                answer.append(event.text)
            else:
                done = event
    return AskResponse(
        answer="".join(answer),
        finish_reason=done.finish_reason,
        retrieval=RetrievalPublic.model_validate(asdict(retrieval)) if retrieval else None,
        usage=usage_of(done),
        timings=timings(timer, done, retrieval),
    )


async def _ask_events(
    events: AsyncIterator[GenerationEvent], metrics: Metrics, timer: GenerationTimer
) -> AsyncGenerator[bytes, None]:
    retrieval: Retrieval | None = None
    async for event in events:
        observe(metrics, event, timer)
        if isinstance(event, Retrieval):
            retrieval = event
            yield sse(asdict(event), event="retrieval")
        elif isinstance(event, TokenDelta):
            yield sse({"text": event.text}, event="delta")
        else:
            body = {
                "finish_reason": event.finish_reason,
                "usage": usage_of(event).model_dump(),
                "timings": timings(timer, event, retrieval).model_dump(),
            }
            yield sse(body, event="done")
