"""The served models: each loaded once, with its worker, stop tokens, what its memories need of it and decode batcher."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequestError, NotFoundError
from engine.interface import GenerationParams, ModelInfo
from engine.memories import MEMORIES, MemoryContext, check_options
from engine.models import manifest as manifests
from engine.models.embedder import Embedder
from engine.models.llama_step import BatchDecoder, native_step
from engine.models.loader import LoadedModel, load_model
from engine.models.native_step import CACHE_DTYPE
from engine.models.quantize import quantize_linears, stored_mode
from engine.runtime.generation import StopTokens, generate_steps
from engine.runtime.kv_blocks import Held, KVBlocks
from engine.runtime.os_memory import return_free_memory
from engine.runtime.prefix_cache import PrefixCache
from engine.runtime.scheduler import Batcher
from engine.runtime.worker import SerialWorker

log = logging.getLogger(__name__)


# 70 tokens on SmolLM2: a prefill, a decode step and the repetition guard's vocabulary scan, on the model's own path
WARM_UP_TEXT = " ".join(["A short passage read once before the first request, and thrown away."] * 5)


def valid_manifest_options(model_name: str, manifest: dict) -> dict[str, dict]:
    """Per memory kind, the default options a model's manifest sets; those of a memory this
    server does not have, or that the memory refuses, are logged and left out."""
    kept: dict[str, dict] = {}
    for kind, options in manifests.memory_options(manifest).items():
        try:
            check_options(kind, options)
        except InvalidRequestError as exc:
            log.warning("model %s: ignoring its manifest's options for memory %r: %s", model_name, kind, exc)
            continue
        kept[kind] = options
    return kept


@dataclass
class ModelRuntime:
    loaded: LoadedModel
    worker: SerialWorker
    stop_tokens: StopTokens
    resources: dict[str, Any]  # per memory kind, what its `model_resources` made for this model
    batcher: Batcher | None = None  # None: the model's answers are decoded one request at a time

    @functools.cached_property
    def manifest(self) -> dict:
        """The model's manifest (read once)."""
        return manifests.manifest_of(self.loaded.name, self.loaded.source)

    @property
    def manifest_memory(self) -> str:
        """The default memory the model's manifest names."""
        return manifests.default_memory(self.manifest)

    @functools.cached_property
    def manifest_options(self) -> dict[str, dict]:
        """Per memory kind, the default options the model's manifest sets (`valid_manifest_options`)."""
        return valid_manifest_options(self.loaded.name, self.manifest)

    @functools.cached_property
    def generation_defaults(self) -> dict[str, float]:
        """The sampling the model's manifest sets for requests that leave it out."""
        return manifests.generation_defaults(self.manifest)

    def memory_context(self, embedder: Embedder | None) -> MemoryContext:
        loaded = self.loaded
        return MemoryContext(
            tokenizer=loaded.tokenizer,
            embedder=embedder,
            resources=self.resources,
            state_model=loaded.model if loaded.own_memory is not None else None,
            model=None if loaded.own_memory is not None else loaded.model,
            context_len=loaded.context_len,
            manifest_options=self.manifest_options,
        )

    @functools.cached_property
    def memories(self) -> tuple[str, ...]:
        """The memories a session on this model can use."""
        context = self.memory_context(None)
        return tuple(kind for kind, memory in MEMORIES.items() if memory.available(context))

    def info(self) -> ModelInfo:
        return ModelInfo(
            name=self.loaded.name,
            source=self.loaded.source,
            architecture=self.loaded.architecture,
            context_len=self.loaded.context_len,
            device=str(self.loaded.device),
            dtype=str(self.loaded.dtype).removeprefix("torch."),
            quantize=self.loaded.quantize,
            memories=self.memories,
        )


class ModelRegistry:
    """Loads every configured model and finds one by name (the first by default)."""

    def __init__(
        self,
        config: EngineConfig,
        require_ready: Callable[[], None],
        reserve: Callable[[int], Held] | None = None,
        reserve_spare: Callable[[int], Held] | None = None,
    ) -> None:
        """`reserve(nbytes)` holds bytes of the server's memory for the batched answers' keys and
        values (None: each answer's are held by its request); `reserve_spare(nbytes)` holds only
        bytes no one else needs, for the prompts the batchers keep (None: none kept)."""
        self.config = config
        self._require_ready = require_ready
        self._reserve = reserve
        self._reserve_spare = reserve_spare
        self._runtimes: dict[str, ModelRuntime] = {}

    def load_all(self) -> None:
        spec = self.config.models
        for source in spec.sources:
            loaded = load_model(source, cache_dir=spec.cache_dir, device=spec.device, dtype=spec.load_dtype)
            if loaded.name in self._runtimes:
                raise ValueError(f"two models are named {loaded.name!r}; serve each folder once")
            worker = SerialWorker(f"model:{loaded.name}", self.config.generation.max_queue)
            resources = {} if loaded.own_memory is not None else self._resources(loaded)
            if loaded.own_memory is None:  # after the resources: the layers an adapter wraps stay in the model's dtype
                quantize_linears(loaded.model, quantize_mode(spec.quantize, loaded))
                loaded.quantize = stored_mode(loaded.model)
                if native_step(loaded.model) is not None:  # its answers keep float32 keys and values
                    loaded.cache_dtype = CACHE_DTYPE
            stop = StopTokens.of(loaded.model, loaded.tokenizer)
            runtime = ModelRuntime(loaded, worker, stop, resources, self._batcher(loaded, worker, stop))
            warm_up(runtime)
            return_free_memory()  # quantizing's and fusing's temporaries, which the heap keeps (engine/runtime/os_memory.py)
            if (
                runtime.manifest_options or runtime.generation_defaults
            ):  # read and checked now: a bad manifest is logged at startup
                log.info("model %s: manifest %s %s", loaded.name, runtime.manifest_options, runtime.generation_defaults)
            self._runtimes[loaded.name] = runtime
            log.info(
                "loaded model %s (%s, %s, quantize %s, on %s)",
                loaded.name,
                loaded.architecture,
                loaded.dtype,
                loaded.quantize,
                loaded.device,
            )

    def _batcher(self, loaded: LoadedModel, worker: SerialWorker, stop: StopTokens) -> Batcher | None:
        if self.config.generation.max_batch == 1 or loaded.own_memory is not None or not BatchDecoder.supports(loaded.model):
            return None
        limits = self.config.generation
        decoder = BatchDecoder(loaded.model, limits.batch_invariant)
        kv = prefix = None
        if self._reserve is not None:
            kv = KVBlocks(self._reserve, limits.kv_block_tokens, loaded.kv_bytes_per_token, limits.kv_wait_seconds)
            if limits.prefix_cache_tokens and self._reserve_spare is not None:
                prefix = PrefixCache(self._reserve_spare, limits.prefix_cache_tokens)
        chunk = limits.prefill_chunk or None
        return Batcher(decoder, worker, loaded.tokenizer, stop, limits.max_batch, chunk, kv, prefix)

    def _resources(self, loaded: LoadedModel) -> dict[str, Any]:
        """Per memory kind, what the memory needs from this model (`Memory.model_resources`)."""
        made = {kind: memory.model_resources(loaded, self.config) for kind, memory in MEMORIES.items()}
        return {kind: resource for kind, resource in made.items() if resource is not None}

    def runtime(self, model: str | None = None) -> ModelRuntime:
        self._require_ready()
        name = model or next(iter(self._runtimes))
        if name not in self._runtimes:
            raise NotFoundError(f"no model {name!r}; loaded: {sorted(self._runtimes)}")
        return self._runtimes[name]

    def serves(self, name: str) -> bool:
        return name in self._runtimes

    def named(self, name: str) -> ModelRuntime:
        """A served model by name, ready or not (a session's model, known to be served)."""
        return self._runtimes[name]

    def runtimes(self) -> list[ModelRuntime]:
        return list(self._runtimes.values())

    def default_memory(self, runtime: ModelRuntime) -> str:
        if self.config.default_memory != "auto":
            return self.config.default_memory
        if runtime.loaded.own_memory is not None:
            return runtime.loaded.own_memory
        kind = runtime.manifest_memory
        if kind not in runtime.memories:
            log.warning(
                "model %s: its manifest's default memory %r is not usable here; using %r",
                runtime.loaded.name,
                kind,
                manifests.FALLBACK_MEMORY,
            )
            return manifests.FALLBACK_MEMORY
        return kind

    def shutdown(self) -> None:
        for runtime in self._runtimes.values():
            runtime.worker.shutdown()


def quantize_mode(asked: str, loaded: LoadedModel) -> str:
    """The weight-only mode a model is served in: the one asked for; for `auto`, on a CPU and over
    float32 or bfloat16 weights, the mode its manifest names (measured), else none."""
    if asked != "auto":
        return asked
    if loaded.device.type != "cpu" or loaded.dtype not in (torch.float32, torch.bfloat16):
        return "none"
    return manifests.cpu_quantize(manifests.manifest_of(loaded.name, loaded.source))


def warm_up(runtime: ModelRuntime) -> None:
    """Answer a short prompt once before the first request (the registry loads on the compute
    thread, before any request). In the first prefill of a freshly started server, some of the
    rotary embedding's cosines now and then came out one bfloat16 step apart, and changed that
    server's first greedy answer; later requests never differed. The cause was not found; with this
    pass first, no start has shown it so far (docs/reliability.md, "first", has the counts). A model
    that answers through its own memory (a plugin) runs none of these paths and is skipped. A
    failure here stops the server from starting, as a failing load does."""
    loaded = runtime.loaded
    if loaded.own_memory is not None:
        return
    params = GenerationParams(max_tokens=2, ignore_eos=True)
    ids = list(loaded.tokenizer(WARM_UP_TEXT, add_special_tokens=False)["input_ids"])
    ids = ids[: max(1, loaded.context_len - params.max_tokens)]
    if runtime.batcher is not None:
        runtime.batcher.warm_up(ids, params)
        return
    for _ in generate_steps(loaded.model, loaded.tokenizer, ids, params, runtime.stop_tokens):
        pass
