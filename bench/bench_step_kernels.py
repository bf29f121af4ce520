"""One C decode step (engine/models/native_step.py) of SmolLM2-135M in its default dtype, at
512 and 2,048 tokens of context for 1, 2, 4 and 8 answers, with the matmuls' AVX2 kernels against
their AVX-512 ones (csrc/weight_only.c), alternating in one process, on the compute thread as the
server runs it. Needs a CPU with AVX-512 (F, BW, VL).

    .venv/bin/python -m bench.bench_step_kernels
"""

from __future__ import annotations

import statistics
import time

from bench.bench_batch_step import filled_rows
from engine.config import DEFAULT_CACHE_DIR, SMALL_MODEL
from engine.models import cpu_kernels
from engine.models.llama_step import BatchDecoder
from engine.models.loader import load_model
from engine.runtime.worker import compute_executor, single_threaded_torch

REPEATS = 20
KERNELS = {"AVX2": False, "AVX-512": True}


def main() -> None:
    loaded = load_model(SMALL_MODEL, cache_dir=DEFAULT_CACHE_DIR, device="cpu", dtype="auto")
    decoder = BatchDecoder(loaded.model)
    assert decoder.native is not None, "the C step cannot run here"
    assert cpu_kernels.use_avx512(True), "no AVX-512 on this CPU"
    print(f"model dtype {loaded.model.dtype}, medians of {REPEATS}\n")
    print("| context | answers | step ms, AVX2 | step ms, AVX-512 | tok/s, AVX2 | tok/s, AVX-512 | AVX-512 / AVX2 |")
    print("|---|---|---|---|---|---|---|")
    for context in (512, 2048):
        for count in (1, 2, 4, 8):
            rows = filled_rows(decoder, loaded.tokenizer, count, context)
            times: dict[str, list[float]] = {name: [] for name in KERNELS}
            for _ in range(REPEATS + 1):  # the first round warms up
                for name, avx512 in KERNELS.items():
                    cpu_kernels.use_avx512(avx512)
                    started = time.perf_counter()
                    decoder.step(rows)
                    times[name].append(time.perf_counter() - started)
            old, new = (statistics.median(times[name][1:]) for name in KERNELS)
            print(
                f"| {context} | {count} | {old * 1e3:.1f} | {new * 1e3:.1f} | {count / old:.1f} | {count / new:.1f} | "
                f"{old / new:.2f}x |",
                flush=True,
            )
    cpu_kernels.use_avx512(True)


if __name__ == "__main__":
    single_threaded_torch()  # the main thread stays out of it: the model runs where the server runs it
    compute_executor().submit(main).result()
