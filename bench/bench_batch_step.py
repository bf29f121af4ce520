"""One batched decode step of the default model in process (float32, rows at 512 tokens) for 1, 2,
3, 4 and 8 answers: unpadded (every count steps as itself, the policy before 2-3 rows were padded
to 4), the default (2-3 padded to 4) and `batch_invariant` (1-3 padded to 4); and why 4 rows: how
much a row of `F.linear` at the model's shapes changes with the number of rows beside it.

    .venv/bin/python -m bench.bench_batch_step
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from engine.batching import BatchDecoder, Row
from engine.config import DEFAULT_CACHE_DIR, DEFAULT_MODEL
from engine.generation import AnswerState, StopTokens
from engine.interface import GenerationParams
from engine.models.loader import load_model

CONTEXT = 512
REPEATS = 8


def filled_rows(decoder: BatchDecoder, tokenizer, count: int) -> list[Row]:
    rows = []
    for i in range(count):
        row = Row(list(range(100 + i, 100 + i + CONTEXT)), GenerationParams(max_tokens=2 * REPEATS + 8))
        row.state = AnswerState(tokenizer, row.prompt_ids, row.params, StopTokens(frozenset()))
        decoder.prefill(row)
        row.state.next_token = 42
        rows.append(row)
    return rows


class Unpadded(BatchDecoder):
    def step_rows(self, answers: int) -> int:
        return answers


def step_times(model, tokenizer) -> None:
    decoders = {
        "unpadded": Unpadded(model),
        "default": BatchDecoder(model),
        "batch_invariant": BatchDecoder(model, invariant=True),
    }
    print(
        "| answers | step ms, unpadded | step ms, default | step ms, batch_invariant | tok/s, unpadded | tok/s, default | tok/s, batch_invariant |"
    )
    print("|---|---|---|---|---|---|---|")
    for count in (1, 2, 3, 4, 8):
        rows = {name: filled_rows(decoder, tokenizer, count) for name, decoder in decoders.items()}
        times: dict[str, list[float]] = {name: [] for name in decoders}
        for name, decoder in decoders.items():
            decoder.step(rows[name])  # warm-up
        for _ in range(REPEATS):  # alternating, so both see the same noise
            for name, decoder in decoders.items():
                started = time.perf_counter()
                decoder.step(rows[name])
                times[name].append(time.perf_counter() - started)
        medians = [statistics.median(times[name]) for name in decoders]
        milliseconds = " | ".join(f"{m * 1000:.0f}" for m in medians)
        rates = " | ".join(f"{count / m:.1f}" for m in medians)
        print(f"| {count} | {milliseconds} | {rates} |")


def linear_regimes(model) -> None:
    """Row 0 of x @ W.T for 1..32 rows, against 1 row and against 4 rows."""
    print("\n| weight (out x in) | max change vs 1 row, at 2-3 rows | at 4+ rows | rows 4-32 bit-identical to 4 |")
    print("|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    layer = model.model.layers[0]
    for weight in (layer.self_attn.q_proj.weight, layer.mlp.up_proj.weight, layer.mlp.down_proj.weight, model.lm_head.weight):
        x = torch.randn(32, weight.shape[1], generator=generator, dtype=weight.dtype)
        with torch.inference_mode():
            rows = {m: F.linear(x[:m], weight)[0] for m in range(1, 33)}
        small = max(float((rows[m] - rows[1]).abs().max()) for m in (2, 3))
        large = max(float((rows[m] - rows[1]).abs().max()) for m in range(4, 33))
        same = all(torch.equal(rows[m], rows[4]) for m in range(4, 33))
        print(f"| {tuple(weight.shape)} | {small:.1e} | {large:.1e} | {same} |")


def main() -> None:
    loaded = load_model(DEFAULT_MODEL, cache_dir=DEFAULT_CACHE_DIR, device="cpu", dtype="float32")
    print(f"torch threads: {torch.get_num_threads()}, context {CONTEXT} tokens, medians of {REPEATS}\n")
    step_times(loaded.model, loaded.tokenizer)
    linear_regimes(loaded.model)


if __name__ == "__main__":
    main()
