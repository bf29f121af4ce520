"""One batched decode step of SmolLM2-135M in process (rows at 512 tokens) for 1, 2, 3, 4
and 8 answers, the decoders alternating: the default (the C step, engine/models/native_step.py),
and the torch step it replaces: unpadded (every count steps as itself), padded (2-3 answers padded
to 4, the float32 rule), its default (padded, unless the projections compute each row alone:
`--quantize`), `batch_invariant` (1-3 padded to 4) and unfused (q/k/v and gate/up separate); and
why 4 rows: how much a row of the model's projections changes with the number of rows beside it.

    .venv/bin/python -m bench.bench_batch_step [--quantize bf16|int8|int4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from engine.config import DEFAULT_CACHE_DIR, SMALL_MODEL
from engine.interface import GenerationParams
from engine.models.llama_step import BatchDecoder, Row, _rows_alone
from engine.models.loader import load_model
from engine.models.quantize import quantize_linears
from engine.runtime.generation import AnswerState, StopTokens

CONTEXT = 512
REPEATS = 24


def filled_rows(decoder: BatchDecoder, tokenizer, count: int, context: int = CONTEXT) -> list[Row]:
    rows = []
    for i in range(count):
        row = Row(list(range(100 + i, 100 + i + context)), GenerationParams(max_tokens=2 * REPEATS + 8))
        row.state = AnswerState(tokenizer, row.prompt_ids, row.params, StopTokens(frozenset()))
        decoder.prefill(row)
        row.state.next_token = 42
        rows.append(row)
    return rows


class TorchStep(BatchDecoder):
    """The step in torch operators, as where the C step cannot run."""

    def __init__(self, model: nn.Module, invariant: bool = False) -> None:
        super().__init__(model, invariant)  # type: ignore[arg-type]
        self.native = None
        self.rows_alone = _rows_alone(self._projections())


class Unpadded(TorchStep):
    def step_rows(self, answers: int) -> int:
        return answers


class Padded(TorchStep):
    """The float32 rule whatever the weights: 2-3 answers padded to 4."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.rows_alone = False


class Unfused(TorchStep):
    """The torch step with q, k and v (and gate and up) as separate matmuls."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.qkv, self.gate_up = [None] * len(self.qkv), [None] * len(self.gate_up)


def step_times(model, tokenizer) -> None:
    decoders = {
        "C step": BatchDecoder(model),
        "torch, unpadded": Unpadded(model),
        "torch, padded": Padded(model),
        "torch": TorchStep(model),
        "torch, batch_invariant": TorchStep(model, invariant=True),
        "torch, unfused": Unfused(model),
    }
    assert decoders["C step"].native is not None, "the C step cannot run here (engine/models/native_step.py)"
    print(
        "| answers | "
        + " | ".join(f"step ms, {name}" for name in decoders)
        + " | "
        + " | ".join(f"tok/s, {name}" for name in decoders)
        + " |"
    )
    print("|---|" + "---|" * 2 * len(decoders))
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
    """Row 0 of a projection of 1..32 rows, against 1 row and against 4 rows (weight-only layers
    widen their weights to float32 past DECODE_ROWS rows, hence the 17-32 column)."""
    print(
        "\n| weight (out x in) | max change vs 1 row, at 2-3 rows | at 4-16 rows | at 17-32 rows | rows 4-16 bit-identical to 4 |"
    )
    print("|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    layer = model.model.layers[0]
    for projection in (layer.self_attn.q_proj, layer.mlp.up_proj, layer.mlp.down_proj, model.lm_head):
        x = torch.randn(32, projection.in_features, generator=generator)
        with torch.inference_mode():
            rows = {m: projection(x[:m])[0] for m in range(1, 33)}
        change = [max(float((rows[m] - rows[1]).abs().max()) for m in span) for span in ((2, 3), range(4, 17), range(17, 33))]
        same = all(torch.equal(rows[m], rows[4]) for m in range(4, 17))
        shape = (projection.out_features, projection.in_features)
        print(f"| {shape} | " + " | ".join(f"{c:.1e}" for c in change) + f" | {same} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantize", default="none", help="none, bf16, int8 or int4 (weight-only, as longdoc serve --quantize)")
    args = parser.parse_args()
    loaded = load_model(SMALL_MODEL, cache_dir=DEFAULT_CACHE_DIR, device="cpu", dtype="float32")
    quantize_linears(loaded.model, args.quantize)
    print(
        f"torch threads: {torch.get_num_threads()}, context {CONTEXT} tokens, medians of {REPEATS}, --quantize {args.quantize}\n"
    )
    step_times(loaded.model, loaded.tokenizer)
    linear_regimes(loaded.model)


if __name__ == "__main__":
    main()
