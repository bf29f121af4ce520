"""Request and response bodies of the longdoc REST API."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="a name from GET /v1/models; defaults to the first")
    memory: str | None = Field(None, description="'truncate', 'text', 'neurocache' (models with an adapter) or 'stream' (CacheFormer/Long-Short checkpoints); defaults to the server's default")
    options: dict[str, Any] = Field(default_factory=dict, description="memory options, e.g. {'top_k': 4}")


class DocumentPublic(BaseModel):
    id: str
    name: str
    chars: int
    tokens: int
    segments: int
    seconds: float


class CachePublic(BaseModel):
    memory: str
    entries: int
    bytes: int
    capacity: int
    documents: int
    turns: int = 0


class SessionPublic(BaseModel):
    id: str
    model: str
    memory: str
    options: dict[str, Any]
    created_at: float
    last_used_at: float
    documents: list[DocumentPublic]
    cache: CachePublic


class SessionList(BaseModel):
    data: list[SessionPublic]


class DocumentList(BaseModel):
    data: list[DocumentPublic]


class DocumentCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1)
    name: str | None = Field(None, max_length=256)
    stream: bool = False


class AskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: str = Field(min_length=1, max_length=8192)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False


class RetrievedItemPublic(BaseModel):
    chunk_id: int
    document_id: str
    char_start: int
    char_end: int
    score: float | None = None


class RetrievalPublic(BaseModel):
    memory: str
    items: list[RetrievedItemPublic]
    seconds: float


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timings(BaseModel):
    ttft_seconds: float
    total_seconds: float
    retrieval_seconds: float | None = None


class AskResponse(BaseModel):
    answer: str
    finish_reason: str
    retrieval: RetrievalPublic | None
    usage: Usage
    timings: Timings


# ---- OpenAI-compatible ---------------------------------------------------------------------


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1, description="only 1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    session_id: str | None = Field(None, description="longdoc extension: answer from this session's memory")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "longdoc"
    context_length: int
    architecture: str
    memories: list[str]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
