"""One C decode step of the default model as served on a CPU (`--quantize int4`, the CPU default,
on the kernels the CPU runs by default) for one answer and for eight at 512 tokens of context, on
the compute thread as the server runs it; medians of 20 alternating steps, and eight answers'
tokens a second over one answer's. Run in two checkouts one after the other to compare trees.

    .venv/bin/python -m bench.bench_eight_answers
"""

from __future__ import annotations

import statistics
import time

from bench.bench_batch_step import filled_rows
from engine.config import DEFAULT_CACHE_DIR, DEFAULT_MODEL
from engine.models.llama_step import BatchDecoder
from engine.models.loader import load_model
from engine.models.quantize import quantize_linears
from engine.runtime.worker import compute_executor, single_threaded_torch

CONTEXT, REPEATS = 512, 20


def measure() -> None:
    loaded = load_model(DEFAULT_MODEL, cache_dir=DEFAULT_CACHE_DIR, device="cpu", dtype="auto")
    quantize_linears(loaded.model, "int4")
    decoder = BatchDecoder(loaded.model)
    assert decoder.native is not None, "the C step cannot run here"
    rows = filled_rows(decoder, loaded.tokenizer, 8, CONTEXT)
    times: dict[int, list[float]] = {1: [], 8: []}
    for _ in range(REPEATS + 1):  # the first round warms up
        for count in (1, 8):
            started = time.perf_counter()
            decoder.step(rows[:count])
            times[count].append(time.perf_counter() - started)
            for row in rows[:count]:
                row.length -= 1  # the next step at the same context, over the same position
    one, eight = statistics.median(times[1][1:]), statistics.median(times[8][1:])
    print(
        f"one answer {one * 1e3:.1f} ms ({1 / one:.1f} tok/s); eight {eight * 1e3:.1f} ms ({8 / eight:.1f} tok/s): {8 * one / eight:.2f}x"
    )


def main() -> None:
    single_threaded_torch()  # this thread starts no OpenMP team: the compute thread's owns the cores
    compute_executor().submit(measure).result()


if __name__ == "__main__":
    main()
