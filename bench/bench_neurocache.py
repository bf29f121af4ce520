"""Neurocache benchmark on SmolLM2-135M, every figure a ratio measured in the same run.

1. Ingestion tokens/s: the base model's forward pass over each segment (what ingesting costs
   without Neurocache) against Neurocache's ingestion (base up to layer r + W_p + append), and
   against the paper's full per-segment pass (retrieve, attend, append).
2. Decode tokens/s: greedy decoding with the model's KV cache, without and with a filled
   Neurocache cache attached (every new token retrieves once), and with larger caches made by
   tiling those states (`--decode-sizes`).
3. Retrieval latency against cache size (16K, 128K, 1M entries): one decode token and one
   1024-token segment, exact search.
4. Bytes per cached token against the model's own KV cache.

    .venv/bin/python -m bench.bench_neurocache [--adapter runs/nc-smollm2/adapter]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from engine.config import DEFAULT_CACHE_DIR, SMALL_MODEL
from engine.interface import GenerationParams
from engine.memories.neurocache.adapter import CacheBinding, Neurocache, NeurocacheConfig
from engine.memories.neurocache.adapter_io import load_adapter
from engine.memories.neurocache.state_cache import StateCache
from engine.models.loader import load_model
from engine.runtime.generation import StopTokens, generate_steps
from research.training.corpus import fetch, split

ROOT = Path(__file__).resolve().parents[1]


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def ingestion(model, neurocache, tokens: list[int], segment_len: int, repeats: int) -> dict[str, float]:
    segments = [torch.tensor([tokens[i : i + segment_len]]) for i in range(0, len(tokens), segment_len)]

    @torch.inference_mode()
    def base() -> None:
        for ids in segments:
            model(input_ids=ids, logits_to_keep=1)

    def compress_only() -> None:
        cache = neurocache.new_cache()
        for ids in segments:
            cache.add(neurocache.compress(ids)[0], document=0)

    @torch.inference_mode()
    def full_pass() -> None:
        cache = neurocache.new_cache()
        for ids in segments:
            with neurocache.attached([cache]) as shared:
                model(input_ids=ids, logits_to_keep=1)
                compressed = shared.compressed
            cache.add(compressed[0], document=0)

    n = sum(s.shape[1] for s in segments)
    return {
        name: n / median_time(fn, repeats)
        for name, fn in (("base forward", base), ("neurocache ingest", compress_only), ("neurocache full pass", full_pass))
    }


def decode(model, tokenizer, neurocache, caches: dict[str, StateCache], new_tokens: int, repeats: int) -> dict[str, float]:
    """Tokens/s of each setting, the median over `repeats` rounds; every round times the base model
    and then each cache back to back, so a slow spell of the machine hits all of them alike."""
    prompt = tokenizer("Tell me what happened in the story, in detail.", add_special_tokens=False)["input_ids"]
    params = GenerationParams(max_tokens=new_tokens)
    nothing = StopTokens(frozenset())

    def run(step_context) -> float:
        started = time.perf_counter()
        for _ in generate_steps(model, tokenizer, prompt, params, nothing, step_context):
            pass
        return time.perf_counter() - started

    contexts = {"base": None} | {name: (lambda c=cache: neurocache.active(CacheBinding([c]))) for name, cache in caches.items()}
    for context in contexts.values():  # warm-up
        run(context)
    rounds = [{name: new_tokens / run(context) for name, context in contexts.items()} for _ in range(repeats)]
    return {name: statistics.median(r[name] for r in rounds) for name in contexts} | {
        f"{name} / base, median of rounds": statistics.median(r[name] / r["base"] for r in rounds) for name in caches
    }


def tiled(neurocache, filled: StateCache, size: int) -> StateCache:
    """A cache of `size` entries holding the filled cache's real states over and over: what a
    lookup costs depends on the number of entries, not on what they hold."""
    cache = neurocache.new_cache(capacity=size)
    real = filled.states[: filled.size]
    for start in range(0, size, real.shape[0]):
        cache.add(real[: size - start], document=0)
    return cache


def retrieval(
    dim: int, sizes: tuple[int, ...], top_k: int, window: int, repeats: int, dtypes: tuple[torch.dtype, ...]
) -> list[tuple[int, str, float, float]]:
    rows = []
    for size in sizes:
        for dtype in dtypes:
            cache = StateCache(capacity=size, dim=dim, dtype=dtype)
            cache.add(torch.nn.functional.layer_norm(torch.randn(size, dim), (dim,)), document=0)
            one, segment = torch.randn(1, dim), torch.randn(1024, dim)
            rows.append(
                (
                    size,
                    str(dtype).removeprefix("torch."),
                    median_time(lambda cache=cache, one=one: cache.search(one, top_k, window), repeats),
                    median_time(lambda cache=cache, segment=segment: cache.search(segment, top_k, window), max(1, repeats // 2)),
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", type=Path, default=None, help="default: a fresh adapter (gates closed)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--segment-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-rounds", type=int, default=7)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16_384, 131_072, 1_048_576])
    parser.add_argument("--decode-sizes", type=int, nargs="*", default=[131_072], help="also decode with caches this large")
    args = parser.parse_args()
    torch.manual_seed(0)
    loaded = load_model(SMALL_MODEL, cache_dir=DEFAULT_CACHE_DIR)
    model, tokenizer = loaded.model, loaded.tokenizer
    if args.adapter:
        neurocache = load_adapter(model, tokenizer, args.adapter)
    else:
        neurocache = Neurocache(model, NeurocacheConfig())
    _, held_out = split(fetch(ROOT / "data" / "corpus"))
    text = "\n".join(p.read_text() for p in held_out)
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"][: args.tokens]
    config = neurocache.config

    ingest = ingestion(model, neurocache, tokens, args.segment_len, args.repeats)
    filled = neurocache.new_cache()
    for i in range(0, len(tokens), args.segment_len):
        filled.add(neurocache.compress(torch.tensor([tokens[i : i + args.segment_len]]))[0], document=0)
    caches = {f"neurocache, {filled.size:,} entries (the text's states)": filled}
    caches.update(
        {f"neurocache, {size:,} entries (those states tiled)": tiled(neurocache, filled, size) for size in args.decode_sizes}
    )
    dec = decode(model, tokenizer, neurocache, caches, args.new_tokens, args.decode_rounds)
    dtypes = tuple(dict.fromkeys((filled.dtype, torch.float32)))  # the serving cache's dtype, and float32
    lookups = retrieval(neurocache.compressed_dim, tuple(args.sizes), config.top_k, config.window, args.repeats, dtypes)

    mc = model.config
    kv_bytes = (
        2 * mc.num_hidden_layers * mc.num_key_value_heads * (mc.hidden_size // mc.num_attention_heads) * loaded.dtype.itemsize
    )
    cache_bytes = filled.nbytes / filled.capacity

    print(f"model {SMALL_MODEL}, {loaded.dtype}, {torch.get_num_threads()} threads; adapter: {args.adapter or 'fresh'}")
    print(f"k={config.top_k} w={config.window} c={config.context} r={config.retrieval_layer} d={neurocache.compressed_dim}\n")
    print(f"| ingestion ({len(tokens)} tokens, n={args.segment_len}) | tokens/s | vs base |\n|---|---|---|")
    for name, tps in ingest.items():
        print(f"| {name} | {tps:,.0f} | {tps / ingest['base forward']:.2f}x |")
    print(f"\n| decode ({args.new_tokens} new tokens) | tokens/s | vs base |\n|---|---|---|")
    for name in ["base", *caches]:
        print(
            f"| {name} | {dec[name]:.1f} | {dec[name] / dec['base']:.2f}x (per round: {dec.get(f'{name} / base, median of rounds', 1.0):.2f}x) |"
        )
    print("\n| cache entries | stored as | one-token lookup (ms) | 1024-token segment lookup (ms) |\n|---|---|---|---|")
    for size, dtype, one, segment in lookups:
        print(f"| {size:,} | {dtype} | {one * 1000:.2f} | {segment * 1000:.1f} |")
    print(f"\n| per cached token | bytes |\n|---|---|\n| model KV cache ({loaded.dtype}) | {kv_bytes:,} |")
    state = str(filled.dtype).removeprefix("torch.")
    print(f"| Neurocache state ({neurocache.compressed_dim} x {state} + two int64 counters) | {cache_bytes:,.0f} |")
    print(f"| ratio | {kv_bytes / cache_bytes:.1f}x |")


if __name__ == "__main__":
    main()
