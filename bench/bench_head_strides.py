"""Why the output head's input gets plain strides (engine/models/loader.py's `_plain_strides`):
SmolLM2-135M's head (49,152 x 576) applied to the last row of a 512-token pass, as
`logits_to_keep=1` hands it over (a [1, 1, d] view whose first stride is still 512·d) and with the
strides of a fresh [1, 1, d] tensor, its weight frozen (as a Neurocache adapter leaves the served
model) or needing gradients, in float32 and bfloat16, on the compute thread. Milliseconds a call,
medians.

    .venv/bin/python -m bench.bench_head_strides
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from engine.runtime.worker import compute_executor, single_threaded_torch

VOCAB, HIDDEN, TOKENS, CALLS = 49_152, 576, 512, 7


def milliseconds(row: torch.Tensor, weight: torch.Tensor) -> float:
    F.linear(row, weight)  # warm-up
    took = []
    for _ in range(CALLS):
        started = time.perf_counter()
        F.linear(row, weight)
        took.append(time.perf_counter() - started)
    return 1000 * statistics.median(took)


def main() -> None:
    print("| dtype | weight | last row as `logits_to_keep` passes it (ms) | plain strides (ms) |")
    print("|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.randn(1, TOKENS, HIDDEN, dtype=dtype)
        strided = hidden[:, -1:, :]
        plain = strided.reshape(-1, HIDDEN).view(strided.shape)
        for frozen in (True, False):
            weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, dtype=dtype), requires_grad=not frozen)
            with torch.inference_mode():
                a, b = milliseconds(strided, weight), milliseconds(plain, weight)
            name = str(dtype).removeprefix("torch.")
            print(f"| {name} | {'frozen' if frozen else 'needs gradients'} | {a:.1f} | {b:.1f} |", flush=True)


if __name__ == "__main__":
    single_threaded_torch()  # the model runs where the server runs it
    compute_executor().submit(main).result()
