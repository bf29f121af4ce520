"""Does Neurocache's kNN find the pass key? Retrieval recall on training-style pass-key episodes.

For each episode the segments before the question are compressed into a cache; then, at every
position of the last segment whose next token is a digit of the answer, the top-k search (with
its window w) runs and we check what it retrieves.
Recall is the share of such queries that retrieve that very digit (the i-th digit of the key, for
the i-th digit of the answer) in the needle. A random pick of k*w entries
from the cache gives the "chance" column.

    .venv/bin/python -m bench.neurocache_retrieval --adapter runs/nc2/smollm2-135m-instruct [--episodes 20]
    (no --adapter: a fresh, untrained W_p)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from engine.config import DEFAULT_CACHE_DIR, SMALL_MODEL
from engine.memories.neurocache.adapter import Neurocache, NeurocacheConfig
from engine.memories.neurocache.adapter_io import load_adapter
from engine.models.loader import load_model
from research.training.corpus import DEFAULT_DIR, fetch, split
from research.training.neurocache_data import EpisodeSampler, tokenize_files
from research.training.neurocache_data import needle as needle_ids


def needle_digit_positions(ids: list[int], fact: list[int], key_ids: list[int]) -> list[set[int]]:
    """For digit i of the key: its positions inside the needle sentence (the key is stated twice
    there); digits elsewhere in the filler do not count."""
    at = next(i for i in range(len(ids) - len(fact) + 1) if ids[i : i + len(fact)] == fact)
    starts = [j for j in range(len(fact) - len(key_ids) + 1) if fact[j : j + len(key_ids)] == key_ids]
    return [{at + j + i for j in starts} for i in range(len(key_ids))]


@torch.inference_mode()
def episode_recall(neurocache: Neurocache, episode, segment_len: int, tokenizer) -> tuple[int, int, int, float]:
    """(queries, queries retrieving a needle digit, queries whose nearest match is followed by
    that digit, chance of retrieving it with a random pick)."""
    ids, answer = episode.token_ids, episode.answer_mask
    last = len(ids) - segment_len
    cache = neurocache.new_cache(capacity=len(ids))
    for start in range(0, last, segment_len):
        cache.add(neurocache.compress(torch.tensor([ids[start : start + segment_len]]))[0], document=0)
    text = tokenizer.decode(ids[:last])
    key = text.split("The pass key is ")[1][:5]
    key_ids = [tokenizer.convert_tokens_to_ids(d) for d in key]
    needle = needle_digit_positions(ids, needle_ids(tokenizer, key), key_ids)
    queries = neurocache.compress(torch.tensor([ids[last:]]))[0]
    k, w = neurocache.config.top_k, neurocache.config.window
    _, rows = cache.nearest(queries.float(), min(k, cache.size))  # T, k
    matched = cache.slot_counter[rows]  # write counters = positions in the episode
    windows = (matched.unsqueeze(-1) + torch.arange(w)).flatten(1)  # T, k*w: each match and what follows
    answer_digits = [last + pos for pos in range(len(ids) - last) if answer[last + pos] and ids[last + pos] in key_ids]
    hits, first, asked = 0, 0, 0
    for i, target in enumerate(answer_digits[: len(key_ids)]):  # the i-th digit is predicted at target - 1
        asked += 1
        window = windows[target - 1 - last].tolist()
        hits += bool(set(window) & needle[i])
        first += w > 1 and window[1] in needle[i]  # rank 0, offset 1: the state after the nearest match
    chance = 1 - (1 - len(needle[0]) / max(cache.size, 1)) ** (k * w)
    return asked, hits, first, float(chance)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", type=Path)
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--segment-len", type=int, default=128)
    parser.add_argument("--n-segments", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    loaded = load_model(SMALL_MODEL, cache_dir=DEFAULT_CACHE_DIR, dtype="float32")
    model, tokenizer = loaded.model, loaded.tokenizer
    if args.adapter:
        neurocache = load_adapter(model, tokenizer, args.adapter)
    else:
        neurocache = Neurocache(model, NeurocacheConfig())
    train_files, _ = split(fetch(DEFAULT_DIR))
    sampler = EpisodeSampler(
        tokenizer,
        tokenize_files(tokenizer, train_files),
        segment_len=args.segment_len,
        n_segments=args.n_segments,
        passkey_ratio=1.0,
        seed=123,
    )
    asked = hits = firsts = 0
    chances = []
    for _ in range(args.episodes):
        a, h, f, c = episode_recall(neurocache, sampler.sample(), args.segment_len, tokenizer)
        asked, hits, firsts = asked + a, hits + h, firsts + f
        chances.append(c)
    print(
        f"adapter: {args.adapter or 'fresh (untrained W_p)'}; {args.episodes} episodes of "
        f"{args.n_segments} x {args.segment_len} tokens; k={neurocache.config.top_k}, w={neurocache.config.window}"
    )
    print("| digit queries | retrieving a needle digit | recall | chance | nearest match followed by it |")
    print("|---|---|---|---|---|")
    print(
        f"| {asked} | {hits} | {hits / max(asked, 1):.2f} | {sum(chances) / len(chances):.2f} | "
        f"{firsts} ({firsts / max(asked, 1):.2f}) |"
    )


if __name__ == "__main__":
    main()
