"""How long an answer being decoded waits while a long prompt joins the batch, by `prefill_chunk`.

In process, SmolLM2-135M in float32 on the server's one compute thread: one answer decodes
after a 512-token prompt; after its 5th token an 8,000-token prompt arrives. Printed per chunk
size: the long prompt's time to its first token, and the decoding answer's longest and median
wait between tokens until then.

    .venv/bin/python -m bench.bench_prefill_chunks [--chunks 0 256 512 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from engine.config import DEFAULT_CACHE_DIR, SMALL_MODEL
from engine.interface import GenerationParams
from engine.models.llama_step import BatchDecoder
from engine.models.loader import load_model
from engine.runtime.generation import StopTokens
from engine.runtime.scheduler import Batcher
from engine.runtime.worker import SerialWorker, compute_executor, single_threaded_torch

DECODING_PROMPT, LONG_PROMPT = list(range(1000, 1512)), list(range(2000, 10000))


async def measure(batcher: Batcher) -> tuple[float, float, float]:
    """(the long prompt's TTFT, the longest and the median gap of the decoding answer meanwhile)."""
    times: list[float] = []
    marks: dict[str, float] = {}

    async def decoding() -> None:
        async for _ in batcher.generate(DECODING_PROMPT, GenerationParams(max_tokens=400, temperature=0.0)):
            times.append(time.perf_counter())

    task = asyncio.create_task(decoding())
    while len(times) < 5:
        await asyncio.sleep(0.01)
    marks["arrive"] = time.perf_counter()
    async for _ in batcher.generate(LONG_PROMPT, GenerationParams(max_tokens=2, temperature=0.0)):
        marks.setdefault("first", time.perf_counter())
    await asyncio.sleep(1)  # the decoding answer's tokens of the same steps
    task.cancel()
    gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b > marks["arrive"] and a < marks["first"]]
    return marks["first"] - marks["arrive"], max(gaps), statistics.median(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 256, 512, 1024], help="prefill_chunk values (0: whole)")
    args = parser.parse_args()
    single_threaded_torch()  # this thread starts no OpenMP team: the compute thread's owns the cores
    run = compute_executor().submit
    loaded = run(lambda: load_model(SMALL_MODEL, cache_dir=DEFAULT_CACHE_DIR, device="cpu", dtype="float32")).result()
    decoder = run(lambda: BatchDecoder(loaded.model)).result()
    print("| prefill_chunk | long prompt's TTFT s | decoding answer's longest wait s | its median wait s |")
    print("|---|---|---|---|")
    for chunk in args.chunks:
        batcher = Batcher(decoder, SerialWorker("bench", 16), loaded.tokenizer, StopTokens(frozenset()), 8, chunk or None)
        ttft, longest, median = asyncio.run(measure(batcher))
        print(f"| {chunk or 'whole prompt'} | {ttft:.1f} | {longest:.2f} | {median:.2f} |")


if __name__ == "__main__":
    main()
