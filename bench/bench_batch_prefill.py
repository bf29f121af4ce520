"""Prefill throughput against batch size: SmolLM2-135M (float32) runs 1, 2, 4 and 8 prompts
of 560 tokens in one forward pass each, on the compute thread (medians of 3). Whether batching
prefills could bring the TTFT of 8 streams arriving together near a lone stream's (issue 16):
only if a batch prefills far faster per token than one prompt does.

    .venv/bin/python -m bench.bench_batch_prefill
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import DynamicCache

from engine.config import DEFAULT_CACHE_DIR, SMALL_MODEL
from engine.models.loader import load_model
from engine.runtime.worker import compute_executor, single_threaded_torch

PROMPT = 560  # the batching benchmark's prompts (bench/bench_batching.py)


def main() -> None:
    model = load_model(SMALL_MODEL, cache_dir=DEFAULT_CACHE_DIR, device="cpu", dtype="float32").model
    torch.manual_seed(0)

    @torch.inference_mode()
    def seconds(batch: int) -> float:
        ids = torch.randint(100, 40_000, (batch, PROMPT))
        started = time.perf_counter()
        model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
        return time.perf_counter() - started

    seconds(1), seconds(2)  # warm-up
    print(f"| prompts of {PROMPT} tokens in one pass | seconds (median of 3) | prefill tok/s | vs one prompt |")
    print("|---|---|---|---|")
    alone = 0.0
    for batch in (1, 2, 4, 8):
        took = statistics.median(seconds(batch) for _ in range(3))
        rate = batch * PROMPT / took
        alone = alone or rate
        print(f"| {batch} | {took:.2f} | {rate:.0f} | {rate / alone:.2f}x |", flush=True)


if __name__ == "__main__":
    single_threaded_torch()  # the main thread stays out of it: the model runs where the server runs it
    compute_executor().submit(main).result()
