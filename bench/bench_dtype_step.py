"""SmolLM2-135M's prefill and decode speed in float32 and in bfloat16, on the compute thread
(as the server runs them): a 512-token prompt's prefill (`BatchDecoder.prefill`) and a lone
answer's decode step at 512 tokens of context. Both decode with the C step
(engine/models/native_step.py), which reads a bfloat16 model's weights in bfloat16; the prefill
runs in torch in the model's dtype. On a CPU with fast bfloat16 (`--dtype auto` picks bfloat16
there) this says what that choice costs and gains.

    .venv/bin/python -m bench.bench_dtype_step [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine.config import SMALL_MODEL, operator_cache_dir
from engine.interface import GenerationParams
from engine.models.llama_step import BatchDecoder, Row
from engine.models.loader import load_model
from engine.runtime.generation import AnswerState, StopTokens
from engine.runtime.worker import compute_executor, single_threaded_torch

CONTEXT = 512
STEPS = 20  # decode steps timed after each prefill
PREFILLS = 3


def measure(dtype: str) -> tuple[str, float, float]:
    """(step kind, prefill tok/s, decode tok/s), medians."""
    loaded = load_model(SMALL_MODEL, cache_dir=operator_cache_dir(), device="cpu", dtype=dtype)
    decoder = BatchDecoder(loaded.model)

    def prefilled() -> tuple[Row, float, AnswerState]:
        row = Row(list(range(100, 100 + CONTEXT)), GenerationParams(max_tokens=STEPS + 8))
        state = row.state = AnswerState(loaded.tokenizer, row.prompt_ids, row.params, StopTokens(frozenset()))
        started = time.perf_counter()
        decoder.prefill(row)
        took = time.perf_counter() - started
        state.next_token = 42
        return row, took, state

    prefilled()  # warm-up
    prefills, steps = [], []
    for _ in range(PREFILLS):
        row, took, state = prefilled()
        prefills.append(took)
        for _ in range(STEPS):
            started = time.perf_counter()
            decoder.step([row])
            steps.append(time.perf_counter() - started)
            state.next_token = 42
    kind = "C step" if decoder.native is not None else "torch step"
    return kind, CONTEXT / statistics.median(prefills), 1 / statistics.median(steps)


def main(rounds: int) -> None:
    print("| dtype | decode step | prefill tok/s, 512 tokens | decode tok/s at 512 |")
    print("|---|---|---|---|")
    for _ in range(rounds):  # alternated, so drift touches both
        for dtype in ("float32", "bfloat16"):
            kind, prefill, decode = measure(dtype)
            print(f"| {dtype} | {kind} | {prefill:,.0f} | {decode:.1f} |", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    single_threaded_torch()  # the main thread stays out of it: the model runs where the server runs it
    compute_executor().submit(main, args.rounds).result()
