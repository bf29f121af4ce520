"""Request and response bodies of the longdoc REST API."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from engine.interface import (
    MAX_NO_REPEAT_NGRAM_SIZE,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    NO_REPEAT_NGRAM_SIZE,
    REPETITION_PENALTY,
    SEED_RANGE,
)

MAX_STOP_STRINGS = 8  # OpenAI allows 4; a few more cost nothing
MAX_STOP_CHARS = 256


def _valid_unicode(text: str) -> str:
    """JSON may carry lone surrogates (\\ud800); no tokenizer can take them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the text holds a lone surrogate at character {exc.start}; send valid Unicode") from None
    return text


# Scalars are strict (no true-as-1, no "1"-as-1) and floats finite; text is valid Unicode.
Text = Annotated[str, AfterValidator(_valid_unicode)]
Flag = Annotated[bool, Field(strict=True)]
TokenCount = Annotated[int, Field(strict=True, ge=1, le=2**31 - 1)]
Temperature = Annotated[float, Field(strict=True, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)]
TopP = Annotated[float, Field(strict=True, gt=0.0, le=1.0, allow_inf_nan=False)]
Seed = Annotated[int, Field(strict=True, ge=SEED_RANGE[0], le=SEED_RANGE[1])]
NoRepeatNgram = Annotated[
    int,
    Field(
        strict=True,
        ge=0,
        le=MAX_NO_REPEAT_NGRAM_SIZE,
        description="the answer never repeats an n-gram of its own of this many tokens (0: off)",
    ),
]
RepetitionPenalty = Annotated[
    float,
    Field(
        strict=True,
        ge=1.0,
        le=MAX_REPETITION_PENALTY,
        allow_inf_nan=False,
        description="logits of tokens already in the answer divided by this (1: off)",
    ),
]
StopString = Annotated[Text, Field(max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
DocumentIds = Annotated[list[Annotated[Text, Field(max_length=64)]], Field(min_length=1, max_length=1024)]
DOCUMENTS = "answer from these of the session's documents only (their ids; text memory); all when left out"
IGNORE_EOS = "the model's end-of-sequence tokens do not end the answer: it runs to max_tokens or a stop string"


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text | None = Field(None, max_length=256, description="a name from GET /v1/models; defaults to the first")
    memory: Text | None = Field(
        None,
        description="'truncate', 'text', 'neurocache' (models with an adapter), 'kvcache' (Llama-family models) or 'state' (CacheFormer/Long-Short checkpoints); defaults to the server's default",
    )
    options: dict[str, Any] = Field(default_factory=dict, description="memory options, e.g. {'top_k': 4}")


class DocumentPublic(BaseModel):
    id: str
    name: str
    chars: int
    tokens: int
    segments: int
    seconds: float
    warning: str | None = Field(
        None, description="set when the session's memory could not keep all of the document (a window or a full cache)"
    )
    format: str = Field("text", description="text, markdown, html, pdf, epub or docx: what the upload was parsed as")
    title: str | None = Field(None, description="the title the file gives itself (PDF metadata, HTML <title>, EPUB)")
    page_count: int = Field(0, description="pages (PDF); 0 for formats without pages")
    section_count: int = Field(0, description="headings found (chapters, sections); GET the document for its outline")

    @model_validator(mode="before")
    @classmethod
    def _flatten_layout(cls, data: Any) -> Any:
        """An engine DocumentInfo (as a dict) carries its layout nested; the API shows its summary."""
        if isinstance(data, dict) and isinstance(data.get("layout"), dict):
            layout = data["layout"]
            data = {k: v for k, v in data.items() if k != "layout"}
            data |= {"format": layout["format"], "title": layout["title"]}
            data |= {"page_count": len(layout["pages"]), "section_count": len(layout["sections"])}
        return data


class SectionPublic(BaseModel):
    title: str
    level: int = Field(description="1 for a chapter or top heading, 2 below it, ...")
    char_start: int
    page: int | None = Field(None, description="the 1-based page it starts on (PDF)")


class DocumentDetail(DocumentPublic):
    outline: list[SectionPublic] = Field(default_factory=list, description="the document's headings, in order")
    pages: list[int] = Field(default_factory=list, description="the character where each page starts in the extracted text (PDF)")


class CachePublic(BaseModel):
    memory: str
    entries: int
    bytes: int
    capacity: int
    documents: int
    turns: int = 0
    dropped_tokens: int = Field(0, description="tokens of the session's documents the memory no longer holds")
    bytes_per_token: int = Field(0, description="bytes one more document token costs this memory (0: not reported)")
    summaries: int = Field(0, description="text memory with 'summarize': summaries written in the background so far")
    summaries_planned: int = Field(0, description="how many the documents' summary trees have when whole")
    summary_state: str | None = Field(None, description="'building', 'ready' or 'stopped: <why>'; null: no summaries")


class SessionPublic(BaseModel):
    id: str
    model: str
    memory: str
    options: dict[str, Any]
    created_at: float
    last_used_at: float
    documents: list[DocumentPublic]
    cache: CachePublic
    owner: str | None = Field(None, description="the name of the API key that made it (when keys are configured)")
    resident: bool = Field(True, description="in RAM; false: saved on disk and loaded back on its next use")


class SessionList(BaseModel):
    data: list[SessionPublic]


class DocumentList(BaseModel):
    data: list[DocumentPublic]


class DocumentCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: Text = Field(min_length=1)
    name: Text | None = Field(None, max_length=256)
    stream: Flag = False


class AskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: Text = Field(min_length=1, description="at most `max_prompt_chars` characters (a server setting)")
    max_tokens: TokenCount | None = None
    temperature: Temperature = Field(0.0, description="0 is greedy; below 1e-5 too")
    top_p: TopP = 1.0
    seed: Seed | None = None
    stop: Stop | None = None
    no_repeat_ngram_size: NoRepeatNgram = NO_REPEAT_NGRAM_SIZE
    repetition_penalty: RepetitionPenalty = REPETITION_PENALTY
    ignore_eos: Flag = Field(False, description=IGNORE_EOS)
    stream: Flag = False
    documents: DocumentIds | None = Field(None, description=DOCUMENTS)


class RetrievedItemPublic(BaseModel):
    chunk_id: int
    document_id: str
    char_start: int
    char_end: int
    score: float | None = None
    layers: int | None = Field(None, description="kvcache: in how many layers the prompt pass selected this segment")
    gathered: str | None = Field(
        None,
        description="text memory with gather: 'whole' (every sentence naming the question's names), 'exact' "
        "(the sentences naming all of them, one hop) or 'lookup' (those naming most, one hop, before ranked chunks); "
        "text memory with locate: 'tail' (the end of the chapter or document an ending question names) or 'located' "
        "(a chunk ranked within the chapter the question names); "
        "text memory with summarize: 'summary' (a summary of the characters char_start..char_end, its words in text); "
        "absent for a ranked chunk (one that took in a gathered sentence carries its mark)",
    )
    text: str | None = Field(None, description="a summary's words; absent where the passage is the document's own text")
    document_name: str | None = None
    page_start: int | None = Field(None, description="the 1-based page the passage starts on (PDF)")
    page_end: int | None = Field(None, description="the page it ends on")
    section: str | None = Field(None, description="the heading (chapter, section) the passage falls under")


class RetrievalPublic(BaseModel):
    memory: str
    items: list[RetrievedItemPublic]
    seconds: float
    strategy: str | None = Field(
        None,
        description="how the memory chose the items; text: 'ranked', or the items' gathered marks joined by '+' "
        "('whole', 'located+tail', 'summary+whole'); absent where the memory names none",
    )


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
    content: Text


class StreamOptions(BaseModel):
    include_usage: Flag = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use

    model: Text | None = Field(None, max_length=256)
    messages: list[ChatMessage] = Field(
        min_length=1, max_length=1024, description="together at most `max_prompt_chars` characters"
    )
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    temperature: Temperature | None = Field(None, description="left out: the model manifest's, else 1 (OpenAI's)")
    top_p: TopP | None = Field(None, description="left out: the model manifest's, else 1")
    seed: Seed | None = None
    stop: Stop | None = None
    no_repeat_ngram_size: NoRepeatNgram = Field(
        NO_REPEAT_NGRAM_SIZE, description="longdoc extension (as in vLLM's extra parameters)"
    )
    repetition_penalty: RepetitionPenalty = Field(
        REPETITION_PENALTY, description="longdoc extension (as in vLLM's extra parameters)"
    )
    ignore_eos: Flag = Field(False, description=f"longdoc extension (as in vLLM's extra parameters): {IGNORE_EOS}")
    n: int = Field(1, strict=True, ge=1, le=1, description="only 1 is supported")
    stream: Flag = False
    stream_options: StreamOptions | None = None
    session_id: Text | None = Field(None, max_length=128, description="longdoc extension: answer from this session's memory")
    documents: DocumentIds | None = Field(None, description=f"longdoc extension, with session_id: {DOCUMENTS}")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "longdoc"
    context_length: int
    architecture: str
    memories: list[str]
    dtype: str
    quantize: str = Field(description="weights stored as: none (dtype), bf16, int8 or int4 (longdoc serve --quantize)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
