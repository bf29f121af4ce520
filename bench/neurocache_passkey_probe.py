"""Where does a long-document pass-key miss come from: the kNN search, or the reading of what it found?

Builds the documents of `longdoc eval passkey` (held-out KJV filler, the key stated at a depth),
compresses them into a cache segment by segment as a session does, then runs the question and the
true answer through the adapted model in one teacher-forced pass. For every digit of the key:
- nearest: the state right after the query's nearest match is that digit in the needle;
- in top-k: some retrieved window (k matches, each with its w-1 successors) holds it;
- read: the model's most likely next token is that digit.
It also answers greedily, as the server does, and prints the answer.

    .venv/bin/python -m bench.neurocache_passkey_probe --adapter engine/adapters/smollm2-135m-instruct --length 32768
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

from engine.config import DEFAULT_CACHE_DIR, SMALL_MODEL
from engine.memories.neurocache.adapter_io import load_adapter
from engine.models.loader import load_model
from engine.prompts import render
from research.training.corpus import DEFAULT_DIR, fetch, split
from research.training.evaluate import PASSKEY_QUESTION, passkey_document

SEGMENT = 1024  # the server's default segment length


def key_positions(ids: list[int], key_ids: list[int]) -> list[int]:
    return [i for i in range(len(ids) - len(key_ids) + 1) if ids[i : i + len(key_ids)] == key_ids]


@torch.inference_mode()
def greedy(model, neurocache, cache, prompt: list[int], max_tokens: int = 12) -> list[int]:
    out = []
    with neurocache.attached([cache]):
        step = model(input_ids=torch.tensor([prompt]), use_cache=True)
        for _ in range(max_tokens):
            token = int(step.logits[0, -1].argmax())
            out.append(token)
            step = model(input_ids=torch.tensor([[token]]), past_key_values=step.past_key_values, use_cache=True)
    return out


@torch.inference_mode()
def probe(model, tokenizer, neurocache, document: str, key: str) -> tuple[list[tuple[bool, bool, bool]], str]:
    ids = tokenizer(document, add_special_tokens=False)["input_ids"]
    cache = neurocache.new_cache(capacity=max(len(ids), 1))
    for start in range(0, len(ids), SEGMENT):
        cache.add(neurocache.compress(torch.tensor([ids[start : start + SEGMENT]]))[0], document=0)
    prompt = render(tokenizer, [{"role": "user", "content": PASSKEY_QUESTION}])
    lead = tokenizer("The pass key is", add_special_tokens=False)["input_ids"]
    answer = tokenizer(f"The pass key is {key}.", add_special_tokens=False)["input_ids"]
    key_ids = [tokenizer.convert_tokens_to_ids(d) for d in key]
    first = next(i for i in range(len(lead), len(answer)) if answer[i : i + len(key_ids)] == key_ids)
    full = prompt + answer
    with neurocache.attached([cache]):
        logits = model(input_ids=torch.tensor([full])).logits[0]
    queries = neurocache.compress(torch.tensor([full]))[0].float()
    k, w = neurocache.config.top_k, neurocache.config.window
    _, rows = cache.nearest(queries, k)
    matched = cache.slot_counter[rows].tolist()  # write order = position in the document
    needles = key_positions(ids, key_ids)
    digits = []
    for i in range(len(key_ids)):
        query = len(prompt) + first + i - 1  # the position that predicts digit i
        wanted = {at + i for at in needles}
        nearest = matched[query][0] + 1 in wanted
        in_top_k = any(m + offset in wanted for m in matched[query] for offset in range(w))
        read = int(logits[query].argmax()) == key_ids[i]
        digits.append((nearest, in_top_k, read))
    return digits, tokenizer.decode(greedy(model, neurocache, cache, prompt)).split("<|im_end|>")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", type=Path, required=True)
    parser.add_argument("--length", type=int, action="append", help="document tokens (repeatable)")
    parser.add_argument("--depths", default="0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,0.95")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    loaded = load_model(SMALL_MODEL, cache_dir=DEFAULT_CACHE_DIR, dtype=args.dtype)
    model, tokenizer = loaded.model, loaded.tokenizer
    neurocache = load_adapter(model, tokenizer, args.adapter)
    _, held_out = split(fetch(DEFAULT_DIR))
    filler = next(p for p in held_out if p.name.startswith("kjv-")).read_text()
    print(f"adapter: {args.adapter}; k={neurocache.config.top_k}, w={neurocache.config.window}; {args.dtype}")
    print("| tokens | keys right (greedy) | digits: nearest match's successor | in the top-k windows | read right |")
    print("|---|---|---|---|---|")
    rng = random.Random(0)
    for length in args.length or [32768]:
        right, counts, total = 0, [0, 0, 0], 0
        for depth in map(float, args.depths.split(",")):
            key = str(rng.randrange(10_000, 100_000))
            digits, answer = probe(model, tokenizer, neurocache, passkey_document(filler, length, depth, key, tokenizer), key)
            right += key in answer
            for d in digits:
                counts = [c + flag for c, flag in zip(counts, d, strict=True)]
            total += len(digits)
            print(f"  depth {depth}: key {key}, answered {answer!r}", file=sys.stderr, flush=True)
        trials = len(args.depths.split(","))
        print(f"| {length} | {right}/{trials} | {counts[0]}/{total} | {counts[1]}/{total} | {counts[2]}/{total} |", flush=True)


if __name__ == "__main__":
    main()
