"""The default model's output head in int8 (`--quantize int4`'s) against int4 (tried 2026-11-28, not kept):
one C decode step of 1 and 8 answers at 512 tokens of context, the two models alternating in one
process, on the compute thread as the server runs it, medians of 20 steps.

    .venv/bin/python -m bench.bench_head
"""

from __future__ import annotations

import statistics
import time

from torch import nn

from bench.bench_batch_step import filled_rows
from engine.config import DEFAULT_CACHE_DIR, DEFAULT_MODEL
from engine.models import quantize
from engine.models.llama_step import BatchDecoder
from engine.models.loader import LoadedModel, load_model
from engine.runtime.worker import compute_executor, single_threaded_torch

REPEATS = 20


def build(head_mode: str) -> tuple[LoadedModel, BatchDecoder]:
    """The default model at `--quantize int4`, its head converted to `head_mode`."""
    loaded = load_model(DEFAULT_MODEL, cache_dir=DEFAULT_CACHE_DIR, device="cpu", dtype="auto")
    chosen = quantize._layer_mode

    def layer_mode(name: str, linear: nn.Linear, mode: str) -> str:
        return head_mode if name == "lm_head" else chosen(name, linear, mode)

    quantize._layer_mode = layer_mode
    try:
        quantize.quantize_linears(loaded.model, "int4")
    finally:
        quantize._layer_mode = chosen
    decoder = BatchDecoder(loaded.model)
    assert decoder.native is not None, "the C step cannot run here"
    return loaded, decoder


def main() -> None:
    models = {mode: build(mode) for mode in ("int8", "int4")}
    print(f"{DEFAULT_MODEL}, --quantize int4, 512 tokens of context, medians of {REPEATS}\n")
    print("| answers | step ms, int8 head | step ms, int4 head | tok/s, int8 head | tok/s, int4 head | ratio |")
    print("|---|---|---|---|---|---|")
    for count in (1, 8):
        rows = {mode: filled_rows(decoder, loaded.tokenizer, count, 512) for mode, (loaded, decoder) in models.items()}
        times: dict[str, list[float]] = {mode: [] for mode in models}
        for _ in range(REPEATS + 1):  # the first round warms up
            for mode, (_, decoder) in models.items():
                started = time.perf_counter()
                decoder.step(rows[mode])
                times[mode].append(time.perf_counter() - started)
        old, new = (statistics.median(times[mode][1:]) for mode in ("int8", "int4"))
        print(f"| {count} | {old * 1e3:.1f} | {new * 1e3:.1f} | {count / old:.1f} | {count / new:.1f} | {old / new:.2f}x |")


if __name__ == "__main__":
    single_threaded_torch()  # the main thread stays out of it: the model runs where the server runs it
    compute_executor().submit(main).result()
