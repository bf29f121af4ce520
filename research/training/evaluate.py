"""`longdoc eval ppl|passkey`: Neurocache against the baselines, on held-out text only (`eval qa`: research/evals/qa.py).

- ppl: held-out documents fed in segments of n tokens; the base model with its local window
  only (each segment alone, positions restarting) against the same segments with the Neurocache
  cache of everything before them, at two cache sizes.
- passkey goes through the real engine (ingestion, retrieval, generation) per memory mode.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from engine.config import SHIPPED_ADAPTERS, SHIPPED_EMBEDDER_ADAPTER, SMALL_MODEL, EngineConfig, ModelSpec, operator_cache_dir
from engine.engine import Engine
from engine.interface import GenerationParams, Retrieval, RetrievedItem, TokenDelta
from engine.memories.neurocache.adapter_io import load_adapter
from engine.models.loader import load_model
from research.training.corpus import DEFAULT_DIR, fetch, split

PASSKEY_QUESTION = "What is the pass key? Answer with the number."


@dataclass(frozen=True)
class EvalSetup:
    model: str = SMALL_MODEL
    adapter: Path | None = None  # folder with adapter.json; None: the shipped adapter if any
    corpus_dir: Path = DEFAULT_DIR
    cache_dir: Path = field(default_factory=operator_cache_dir)  # LONGDOC_CACHE_DIR, as the server's
    device: str = "auto"
    quantize: str = "auto"  # weight-only, as longdoc serve --quantize (engine/models/quantize.py)
    embedder_adapter: Path | None = SHIPPED_EMBEDDER_ADAPTER  # the text memory's MiniLM adapter; None: none


def _adapter_dirs(setup: EvalSetup) -> tuple[Path, ...]:
    """Engine adapter folders: the one given (its parent holds <model name>/) or the shipped ones."""
    if setup.adapter is None:
        return (SHIPPED_ADAPTERS,)
    return (setup.adapter.parent,) if setup.adapter.name == Path(setup.model).name else (setup.adapter,)


# ---- perplexity ---------------------------------------------------------------------------


@torch.inference_mode()
def segment_nll(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, int]:
    """Summed next-token loss inside one segment [1, n] and the number of predictions."""
    logits = model(input_ids=ids).logits[0, :-1].float()
    return float(F.cross_entropy(logits, ids[0, 1:], reduction="sum")), ids.shape[1] - 1


def perplexity(setup: EvalSetup, *, segment_len: int, capacities: tuple[int, ...], max_tokens: int) -> list[dict[str, Any]]:
    """Rows: window-only baseline, Neurocache at each capacity, full attention up to the native limit."""
    loaded = load_model(setup.model, cache_dir=setup.cache_dir, device=setup.device, dtype="float32")
    model, tokenizer = loaded.model, loaded.tokenizer
    _, held_out = split(fetch(setup.corpus_dir))
    documents = [tokenizer(p.read_text(), add_special_tokens=False)["input_ids"][:max_tokens] for p in held_out]
    adapter = setup.adapter or SHIPPED_ADAPTERS / loaded.name
    native = min(loaded.context_len, 8192)
    rows = [_ppl_row("base, local window only", documents, model, segment_len, None)]
    rows.append(_ppl_row(f"base, full attention in {native}-token windows (reference)", documents, model, native, None))
    neurocache = load_adapter(model, tokenizer, adapter)
    # the adapter's LoRA alone, its cache never filled: separates what the cache adds from fine-tuning
    rows.append(_ppl_row("base + adapter, cache kept empty", documents, model, segment_len, (neurocache, 0)))
    for capacity in capacities:
        rows.append(_ppl_row(f"base + Neurocache, m = {capacity}", documents, model, segment_len, (neurocache, capacity)))
    return rows


def _ppl_row(name: str, documents: list[list[int]], model: PreTrainedModel, segment_len: int, cached: Any) -> dict[str, Any]:
    total, count = 0.0, 0
    for tokens in documents:
        cache = None
        if cached is not None:
            neurocache, capacity = cached
            cache = neurocache.new_cache(capacity=max(capacity, 1), device=model.device)
        for start in range(0, len(tokens) - 1, segment_len):
            ids = torch.tensor([tokens[start : start + segment_len]], device=model.device)
            if ids.shape[1] < 2:
                continue
            if cache is None:
                nll, n = segment_nll(model, ids)
            else:
                with neurocache.attached([cache]) as shared:
                    nll, n = segment_nll(model, ids)
                    compressed = shared.compressed
                if capacity:
                    cache.add(compressed[0], document=0)  # retrieve, attend, then append
            total, count = total + nll, count + n
    return {"setting": name, "segment_len": segment_len, "tokens": count, "perplexity": math.exp(total / count)}


# ---- pass key and QA through the engine ----------------------------------------------------


def passkey_document(filler: str, length_tokens: int, depth: float, key: str, tokenizer: Any) -> str:
    ids = tokenizer(filler, add_special_tokens=False)["input_ids"]
    while len(ids) < length_tokens:
        ids = ids + ids
    ids = ids[:length_tokens]
    at = int(depth * len(ids))
    head, tail = tokenizer.decode(ids[:at]), tokenizer.decode(ids[at:])
    return f"{head} The pass key is {key}. Remember it. {key} is the pass key. {tail}"


async def _answers(
    engine: Engine,
    memory: str,
    document: str,
    questions: list[str],
    capacity: int | None = None,
    options: dict[str, Any] | None = None,
) -> list[tuple[str, tuple[RetrievedItem, ...]]]:
    """Ingest `document` into a fresh session of `memory` (with `options`) once, then answer each
    question greedily: each answer with the passages its retrieval event named. `capacity` sets a
    neurocache session's m (None: the adapter's)."""
    options = {**(options or {}), **({"capacity": capacity} if memory == "neurocache" and capacity else {})}
    session = engine.create_session(None, memory, options)
    try:
        async for _ in await engine.ingest(session.id, document, "eval"):
            pass
        return [await answer(engine, session.id, question) for question in questions]
    finally:
        engine.delete_session(session.id)


async def answer(engine: Engine, session_id: str, question: str) -> tuple[str, tuple[RetrievedItem, ...]]:
    """A greedy answer of at most 24 tokens from the session, with the passages its retrieval event named."""
    parts: list[str] = []
    sources: tuple[RetrievedItem, ...] = ()
    async for event in await engine.ask(session_id, question, GenerationParams(max_tokens=24)):
        if isinstance(event, TokenDelta):
            parts.append(event.text)
        elif isinstance(event, Retrieval):
            sources = event.items
    return "".join(parts), sources


def holding_key(sources: tuple[RetrievedItem, ...], document: str, key: str) -> list[RetrievedItem]:
    """The passages the retrieval event named that hold part of the key's digits, where the needle
    states them (for kvcache: selected segments; the local window is never named)."""
    starts = [document.index(f"The pass key is {key}") + len("The pass key is "), document.index(f"{key} is the pass key")]
    return [item for item in sources if any(item.char_start < at + len(key) and item.char_end > at for at in starts)]


def _gist(answer: str) -> str:
    """An answer on one line, cut to 40 characters, for the tables' "missed" column."""
    return " ".join(answer.split())[:40]


def _engine(setup: EvalSetup, max_tokens: int) -> Engine:
    spec = ModelSpec(
        sources=(setup.model,),
        device=setup.device,
        quantize=setup.quantize,
        cache_dir=setup.cache_dir,
        adapter_dirs=_adapter_dirs(setup),
    )
    config = EngineConfig(models=spec, embedder_adapter=setup.embedder_adapter)
    # one session may use the server's whole budget: a kvcache session of a book is gigabytes
    sessions = replace(config.sessions, memory_budget_bytes=config.sessions.server_memory_bytes)
    config = replace(config, ingest=replace(config.ingest, max_document_tokens=max_tokens * 2), sessions=sessions)
    return Engine(config)


def run_with_engine(setup: EvalSetup, max_tokens: int, body: Callable[[Engine], Any]) -> Any:
    """Run `body` on a started engine, on an event loop of its own thread: the engine makes its
    loop's thread run torch single-threaded, which should not outlast the run."""

    async def main() -> Any:
        engine = _engine(setup, max_tokens)
        await engine.start()
        try:
            return await body(engine)
        finally:
            await engine.stop()

    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(asyncio.run(main()))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, name="longdoc-eval-loop", daemon=True)  # Ctrl-C does not wait for it
    thread.start()
    thread.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def passkey(
    setup: EvalSetup,
    *,
    memories: tuple[str | tuple[str, dict[str, Any]], ...],
    lengths: tuple[int, ...],
    depths: tuple[float, ...],
    seed: int = 0,
    capacity: int | None = None,
) -> list[dict[str, Any]]:
    """Accuracy per memory (a name, or a name and its session options) and document length, over
    the depths; the filler is held-out text."""
    _, held_out = split(fetch(setup.corpus_dir))
    filler = next(p for p in held_out if p.name.startswith("kjv-")).read_text()
    rng = random.Random(seed)

    async def body(engine: Engine) -> list[dict[str, Any]]:
        tokenizer = engine.tokenizer()
        rows = []
        for run in memories:
            memory, options = (run, {}) if isinstance(run, str) else run
            for length in lengths:
                hits, sourced, named, missed, layers = 0, 0, False, [], []
                for depth in depths:
                    key = str(rng.randrange(10_000, 100_000))
                    document = passkey_document(filler, length, depth, key, tokenizer)
                    answer, sources = (await _answers(engine, memory, document, [PASSKEY_QUESTION], capacity, options))[0]
                    hits += key in answer
                    holding = holding_key(sources, document, key)
                    sourced += bool(holding)
                    named = named or bool(sources)
                    layers.append(max((item.layers or 0 for item in holding), default=0))
                    if key not in answer:
                        missed.append(f"depth {depth}: key {key}, answered {_gist(answer)!r}")
                rows.append(
                    {
                        "memory": f"{memory} {json.dumps(options)}" if options else memory,
                        "length": length,
                        "correct": hits,
                        "key in sources": sourced if named else "-",  # neurocache names no passages
                        # kvcache: in how many layers the prompt pass selected the key's segment, mean over trials
                        "key's layers": f"{sum(layers) / len(layers):.1f}" if memory == "kvcache" else "-",
                        "trials": len(depths),
                        "missed": "; ".join(missed) or "-",
                    }
                )
        return rows

    return run_with_engine(setup, max(lengths), body)


def markdown(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no rows)"
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
    return "\n".join(lines)
