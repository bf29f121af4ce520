"""Does the Neurocache adapter answer a question about a fact in prose from its cache?

Each trial puts four training-style facts (research/training/fact_tasks.py: one asked about, three
about other people) into a window of a held-out book, the asked one at a depth spread from 10% to
90% of what lies before the last 1,100 tokens; ingests it into a fresh cache; asks the fact's
question with greedy decoding; and counts the answer correct when it holds every word of the
expected answer that the question does not already give (the city, the colour, the pet's name...).
The filler is held out; the templates are the ones training uses, so this measures the trained
skill on unseen text, not question answering in general (`longdoc eval qa` does that).

    .venv/bin/python -m bench.neurocache_facts [--adapter DIR] [--tokens 8192] [--trials 8]
"""

from __future__ import annotations

import argparse
import random
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from engine.config import DEFAULT_CACHE_DIR, SHIPPED_ADAPTERS, SMALL_MODEL
from engine.interface import GenerationParams
from engine.memories.neurocache.adapter import CacheBinding
from engine.memories.neurocache.adapter_io import load_adapter
from engine.memories.neurocache.state_cache import StateCache
from engine.models.loader import load_model
from engine.prompts import render
from engine.runtime.generation import StopTokens, generate_steps
from research.training.corpus import DEFAULT_DIR, fetch, split
from research.training.fact_tasks import Fact, facts


def document(
    filler: list[int], tokenizer, told: list[Fact], length: int, depth: float, rng: random.Random, start: int
) -> list[int]:
    ids = list(filler[start : start + length])
    room = length - 1100  # every fact lies outside the question's last segment
    for index, fact in enumerate(told):
        at = int(depth * room) if index == 0 else rng.randrange(0, room)
        ids[at:at] = tokenizer(f" {fact.statement} ", add_special_tokens=False)["input_ids"]
    return ids


def expected_words(fact: Fact) -> set[str]:
    return set(fact.answer.rstrip(".").split()) - set(fact.question.rstrip("?").split())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", type=Path, default=SHIPPED_ADAPTERS / SMALL_MODEL)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--seed", type=int, default=123)
    args = parser.parse_args()
    loaded = load_model(SMALL_MODEL, cache_dir=DEFAULT_CACHE_DIR)
    model, tokenizer = loaded.model, loaded.tokenizer
    neurocache = load_adapter(model, tokenizer, args.adapter)
    _, held_out = split(fetch(DEFAULT_DIR))
    book = next(p for p in held_out if p.name == "kjv-John.txt")
    filler = tokenizer(book.read_text(), add_special_tokens=False)["input_ids"]
    rng = random.Random(args.seed)
    hits = 0
    print("| depth | question | expected | answer | correct |\n|---|---|---|---|---|")
    for trial in range(args.trials):
        told = facts(rng, 4)
        depth = 0.1 + 0.8 * trial / max(1, args.trials - 1)
        ids = document(filler, tokenizer, told, args.tokens, depth, rng, start=trial * 500)
        cache = neurocache.new_cache(capacity=max(len(ids), neurocache.config.capacity))
        for start in range(0, len(ids), 1024):
            cache.add(neurocache.compress(torch.tensor([ids[start : start + 1024]], device=model.device))[0], document=0)
        prompt = render(tokenizer, [{"role": "user", "content": told[0].question}])

        def bound(cache: StateCache = cache) -> AbstractContextManager[object]:  # this trial's cache, bound now
            return neurocache.active(CacheBinding([cache]))

        steps = generate_steps(model, tokenizer, prompt, GenerationParams(max_tokens=20), StopTokens.of(model, tokenizer), bound)
        answer = "".join(getattr(step, "text", "") for step in steps).strip().replace("\n", " ")
        correct = all(word in answer for word in expected_words(told[0]))
        hits += correct
        print(f"| {depth:.2f} | {told[0].question} | {told[0].answer} | {answer[:80]} | {'yes' if correct else 'no'} |")
    print(f"\n{hits}/{args.trials} correct ({args.tokens} tokens, adapter {args.adapter})")


if __name__ == "__main__":
    main()
