"""kvcache's selection against perfect selection, on pass keys or QA questions (SmolLM2-135M unless --model names another, through the engine).

Each pass-key document (`longdoc eval passkey`'s, one per depth) is fed once into a kvcache
session (with the options of `--session` over `top_k` 8 selecting by summaries, the memory's
defaults until 2026-11-26, which this script's figures in docs/studies/kvcache.md were measured with); the question is then asked under each answering config (swapped on the session's
selective model: selection, reselect_every) and, with `forced`, once more with the needle's segment
forced into every layer's and head's picks at every selection. Every config sees the same
documents and keys, so a miss that the forced row shares is the model's reading, not selection.

Prints, per config: pass keys answered, and the mean number of layers (of the model's) whose
prompt pass picked the needle's segment (a needle in the local window counts 0).

With `--qa TEXT`, the QA benchmark's development questions about one text instead: the text is fed
once, and each question is asked with the session's selection
(under each answering config of `--configs`) and with every segment that meets its gold passage
forced into every pick, scored as `longdoc eval qa` scores.

    .venv/bin/python -m bench.kvcache_selection --length 8192 --configs '{}' '{"selection": "keys", "reselect_every": 1}' --forced '{"selection": "keys"}'
    .venv/bin/python -m bench.kvcache_selection --qa asyoulik --session '{"top_k": 1, "window": 128}'
    .venv/bin/python -m bench.kvcache_selection --model qwen2.5-coder-1.5b-instruct --qa asyoulik --session '{"top_k": 2, "selection": "keys"}' --configs '{"reselect_every": 1}' '{"reselect_every": 0}'
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
from collections.abc import Iterator
from typing import Any, cast

import torch

from engine.config import SMALL_MODEL
from engine.engine import Engine
from engine.interface import GenerationParams, RetrievedItem, TokenDelta
from engine.memories.kvcache import select as kv_select
from engine.memories.kvcache.memory import BEFORE_TEXT, KVCacheMemory, KVCacheOptions
from research.evals import qa
from research.evals import texts as qa_texts
from research.training.corpus import fetch, split
from research.training.evaluate import (
    PASSKEY_QUESTION,
    EvalSetup,
    answer,
    holding_key,
    markdown,
    passkey_document,
    run_with_engine,
)

# options that leave the fed store alone: `window` then changes only how much of the document's end
# an answer attends (the rest becomes selectable), `text` the kvcache text index's options (with selection "text")
ANSWERING = {"selection", "reselect_every", "query_pool", "vote", "window", "text", "reread"}
DEPTHS = (0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95)


@contextlib.contextmanager
def forced(*segments: int) -> Iterator[None]:
    """Every selection picks `segments` first, in that order, whatever the scoring: the first
    scores +inf, the others just below it and above every real score."""
    real = kv_select.pick_segments

    def pick(scores: torch.Tensor, eligible: int, top_k: int, neighbours: int) -> list[list[int]]:
        scores = scores.clone()
        above = scores[:, :eligible].max() + len(segments) if eligible else 0.0
        for place, segment in enumerate(segments):
            if segment < eligible:
                scores[:, segment] = float("inf") if place == 0 else above - place
        return real(scores, eligible, top_k, neighbours)

    kv_select.pick_segments = pick
    try:
        yield
    finally:
        kv_select.pick_segments = real


@contextlib.contextmanager
def answering(memory: KVCacheMemory, change: dict[str, Any]) -> Iterator[None]:
    """`memory` answers with the answering options `change` (under `text`, its text index's), then as before."""
    selective, config, text = memory.selective, memory.selective.config, memory.text_index
    text_options = text.options if text is not None else None
    selective.config = dataclasses.replace(config, **{k: v for k, v in change.items() if k != "text"})
    if text is not None:
        text.options = dataclasses.replace(text.options, **change.get("text", {}))
    try:
        yield
    finally:
        selective.config = config
        if text is not None and text_options is not None:
            text.options = text_options


def needle_layers(items: tuple[RetrievedItem, ...], document: str, key: str) -> int:
    """In how many layers the prompt pass picked a segment holding the key (as `eval passkey` counts)."""
    return max((item.layers or 0 for item in holding_key(items, document, key)), default=0)


def check_configs(options: dict[str, Any], configs: list[dict[str, Any]], forced: dict[str, Any] | None) -> None:
    """Answering configs change answering options only, and a forced run goes through
    `pick_segments`, which selection "text" does not call."""
    for config in [*configs, forced or {}]:
        if set(config) - ANSWERING:
            raise SystemExit(f"only answering options can change on a fed session: {sorted(ANSWERING)}")
    if forced is not None and {**options, **forced}.get("selection", KVCacheOptions.selection) == "text":
        raise SystemExit('forcing segments needs a selection that scores ("summary" or "keys"), not "text"')


def run(
    length: int,
    depths: tuple[float, ...],
    configs: list[dict[str, Any]],
    forced_config: dict[str, Any] | None,
    model: str = SMALL_MODEL,
    options: dict[str, Any] = BEFORE_TEXT,
) -> list[dict[str, Any]]:
    check_configs(options, configs, forced_config)
    runs = [(json.dumps(c), c, False) for c in configs]
    if forced_config is not None:
        runs.append((f"forced {json.dumps(forced_config)}", forced_config, True))
    tally: dict[str, list[tuple[bool, int]]] = {name: [] for name, _, _ in runs}

    async def body(engine: Engine) -> None:
        _, held_out = split(fetch(EvalSetup().corpus_dir))
        filler = next(p for p in held_out if p.name.startswith("kjv-")).read_text()
        tokenizer, rng = engine.tokenizer(), random.Random(0)
        for depth in depths:
            key = str(rng.randrange(10_000, 100_000))
            document = passkey_document(filler, length, depth, key, tokenizer)
            at = document.index(f"The pass key is {key}") + len("The pass key is ")  # the key's digits
            session = engine.create_session(None, "kvcache", options)
            async for _ in await engine.ingest(session.id, document, "eval"):
                pass
            memory = cast(KVCacheMemory, engine.sessions.use(session.id).memory)
            base = memory.selective.config
            row = memory.token_at(0, at)
            assert row is not None, "the key's digits were fed"
            segment = (row - base.sinks) // base.segment_len if row >= base.sinks else None  # None: a sink, always attended
            for name, change, force in runs:
                with answering(memory, change), forced(segment) if force and segment is not None else contextlib.nullcontext():
                    text, items = await answer(engine, session.id, PASSKEY_QUESTION)
                tally[name].append((key in text, needle_layers(items, document, key)))
                print(f"depth {depth} {name}: {key in text} layers {tally[name][-1][1]} {text!r}", flush=True)
            engine.delete_session(session.id)

    run_with_engine(EvalSetup(model=model, device="cpu"), length, body)
    return [
        {
            "answering": name,
            "length": length,
            "correct": sum(ok for ok, _ in rows),
            "trials": len(rows),
            "needle's layers (mean)": round(sum(n for _, n in rows) / len(rows), 1),
        }
        for name, rows in tally.items()
    ]


def run_qa(
    text: str,
    options: dict[str, Any],
    model: str = SMALL_MODEL,
    configs: tuple[dict[str, Any], ...] = ({},),
    gold: bool = True,
) -> list[dict[str, Any]]:
    """Development questions about `text`: the session's selection under each answering config,
    then, with `gold`, the gold segments forced (with the session's own answering options; forcing
    goes through `pick_segments`, which selection "text" does not call)."""
    questions = [q for q in qa.load_questions(qa.DEV_QUESTIONS) if q.text == text]
    if not questions:
        raise SystemExit(f"no development question is about {text!r}")
    check_configs(options, list(configs), {} if gold else None)
    runs = [(f"selected {json.dumps(c)}" if c else "selected", c) for c in configs] + ([("gold forced", {})] if gold else [])
    correct = {name: 0 for name, _ in runs}

    async def ask(engine: Engine, session_id: str, question: str) -> str:
        parts = []
        async for event in await engine.ask(session_id, question, GenerationParams(max_tokens=qa.ANSWER_TOKENS)):
            if isinstance(event, TokenDelta):
                parts.append(event.text)
        return "".join(parts)

    async def body(engine: Engine) -> None:
        session = engine.create_session(None, "kvcache", options)
        async for _ in await engine.ingest(session.id, qa_texts.load(text), text):
            pass
        memory = cast(KVCacheMemory, engine.sessions.use(session.id).memory)
        config = memory.selective.config
        for question in questions:
            rows = (memory.token_at(0, char) for char in range(question.start, question.end))
            segments = sorted({(r - config.sinks) // config.segment_len for r in rows if r is not None and r >= config.sinks})
            middle_first = (
                segments[len(segments) // 2 : len(segments) // 2 + 1] + [g for g in segments if g != segments[len(segments) // 2]]
                if segments
                else []
            )
            for name, change in runs:  # the middle gold segment first: its neighbours are the others when top_k is 1
                with answering(memory, change), forced(*middle_first) if name == "gold forced" else contextlib.nullcontext():
                    answer_text = await ask(engine, session.id, question.question)
                hit = qa.is_correct(answer_text, question.answers)
                correct[name] += hit
                print(f"{question.id} {name} (segments {segments}): {hit} {' '.join(answer_text.split())[:80]!r}", flush=True)

    run_with_engine(EvalSetup(model=model, device="cpu"), 200_000, body)
    label = f"kvcache {json.dumps(options)}" if options else "kvcache"
    return [
        {"memory": label, "text": text, "picks": name, "correct": n, "questions": len(questions)} for name, n in correct.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192, help="document tokens")
    parser.add_argument("--configs", nargs="+", default=["{}"], help="answering options, JSON, one run each")
    parser.add_argument("--depth", type=float, action="append", help=f"where the key is, 0..1 (default: {DEPTHS})")
    parser.add_argument("--forced", default=None, help="options of the forced run, JSON (none: no forced run)")
    parser.add_argument("--qa", default=None, help="a development text's name: its QA questions in place of pass keys")
    parser.add_argument(
        "--session",
        default="{}",
        help="the kvcache session's options, JSON, over top_k 8 selecting by summaries (the defaults until 2026-11-26, "
        "which this script's figures were measured with)",
    )
    parser.add_argument("--model", default=SMALL_MODEL, help="a served model by name")
    parser.add_argument("--no-gold", action="store_true", help="with --qa: no run with the gold segments forced")
    args = parser.parse_args()
    session = {**BEFORE_TEXT, **json.loads(args.session)}
    if args.qa is not None:
        print(markdown(run_qa(args.qa, session, args.model, tuple(json.loads(c) for c in args.configs), not args.no_gold)))
        return
    forced_config = json.loads(args.forced) if args.forced is not None else None
    rows = run(
        args.length, tuple(args.depth or DEPTHS), [json.loads(c) for c in args.configs], forced_config, args.model, session
    )
    print(markdown(rows))


if __name__ == "__main__":
    main()
