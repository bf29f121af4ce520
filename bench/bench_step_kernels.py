"""One C decode step (engine/models/native_step.py) at 512 and 2,048 tokens of context for 1, 2,
4 and 8 answers, two kernel sets alternating in one process, on the compute thread as the server
runs it: the matmuls' AVX2 kernels against their AVX-512 ones (csrc/weight_only.c), on
SmolLM2-135M in its default dtype (needs a CPU with AVX-512 F, BW, VL); or, `--int8-inputs`,
int4's kernel on float32 inputs against the one on inputs rounded to int8, on the default model with
`--quantize int4`, with the kernel set the CPU runs by default (AVX-512 with VNNI where it has
them, else AVX2).

`--eight-against-one`: the default model as served (int4, its kernels as the CPU runs them by
default), a step of 1 answer and a step of 8 in turns, round after round, so that the machine's
drift falls on both alike: 8 answers' tokens a second over 1 answer's (issue 62's 3x).

    .venv/bin/python -m bench.bench_step_kernels [--int8-inputs | --eight-against-one]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from bench.bench_batch_step import filled_rows
from engine.config import DEFAULT_CACHE_DIR, DEFAULT_MODEL, SMALL_MODEL
from engine.models import cpu_kernels
from engine.models.llama_step import BatchDecoder
from engine.models.loader import load_model
from engine.models.quantize import quantize_linears
from engine.runtime.worker import compute_executor, single_threaded_torch

REPEATS = 20


def avx512(on: bool) -> None:
    cpu_kernels.use_avx512(on)


def int8_inputs(on: bool) -> None:
    cpu_kernels.use_int8_inputs(on)


def main(switch: Callable[[bool], None], names: tuple[str, str], model: str, quantize: str) -> None:
    loaded = load_model(model, cache_dir=DEFAULT_CACHE_DIR, device="cpu", dtype="auto")
    quantize_linears(loaded.model, quantize)
    decoder = BatchDecoder(loaded.model)
    assert decoder.native is not None, "the C step cannot run here"
    if switch is avx512:
        assert cpu_kernels.use_avx512(True), "no AVX-512 on this CPU"
    else:
        int8_inputs(True)
        assert cpu_kernels.int4_rounds_inputs(), "the AVX-512 kernels here have no VNNI: LONGDOC_CPU_AVX512=0 runs the AVX2 ones"
    old_name, new_name = names
    print(f"{model}, dtype {loaded.model.dtype}, --quantize {quantize}, medians of {REPEATS}\n")
    print(f"| context | answers | step ms, {old_name} | step ms, {new_name} | tok/s, {old_name} | tok/s, {new_name} | ratio |")
    print("|---|---|---|---|---|---|---|")
    for context in (512, 2048):
        for count in (1, 2, 4, 8):
            rows = filled_rows(decoder, loaded.tokenizer, count, context)
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(REPEATS + 1):  # the first round warms up
                for on in (False, True):
                    switch(on)
                    started = time.perf_counter()
                    decoder.step(rows)
                    times[on].append(time.perf_counter() - started)
            old, new = (statistics.median(times[on][1:]) for on in (False, True))
            print(
                f"| {context} | {count} | {old * 1e3:.1f} | {new * 1e3:.1f} | {count / old:.1f} | {count / new:.1f} | "
                f"{old / new:.2f}x |",
                flush=True,
            )
    switch(True)


def eight_against_one() -> None:
    loaded = load_model(DEFAULT_MODEL, cache_dir=DEFAULT_CACHE_DIR, device="cpu", dtype="auto")
    quantize_linears(loaded.model, "int4")
    decoder = BatchDecoder(loaded.model)
    assert decoder.native is not None, "the C step cannot run here"
    print(
        f"{DEFAULT_MODEL}, --quantize int4, int4 rounds its inputs: {cpu_kernels.int4_rounds_inputs()}, int8 (the head): {cpu_kernels.int8_rounds_inputs()}, medians of {REPEATS}\n"
    )
    print("| context | step ms, 1 answer | step ms, 8 answers | tok/s, 1 | tok/s, 8 | 8 over 1 |\n|---|---|---|---|---|---|")
    for context in (512, 2048):
        rows = {count: filled_rows(decoder, loaded.tokenizer, count, context) for count in (1, 8)}
        times: dict[int, list[float]] = {1: [], 8: []}
        for _ in range(REPEATS + 1):  # the first round warms up
            for count in (1, 8):
                started = time.perf_counter()
                decoder.step(rows[count])
                times[count].append(time.perf_counter() - started)
        one, eight = (statistics.median(times[count][1:]) for count in (1, 8))
        print(
            f"| {context} | {one * 1e3:.1f} | {eight * 1e3:.1f} | {1 / one:.1f} | {8 / eight:.1f} | {one * 8 / eight:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    kinds = parser.add_mutually_exclusive_group()
    kinds.add_argument("--int8-inputs", action="store_true", help="int4 on float32 inputs against int8 ones, default model")
    kinds.add_argument("--eight-against-one", action="store_true", help="8 answers' step against 1 answer's, in turns")
    args = parser.parse_args()
    if args.eight_against_one:
        single_threaded_torch()
        compute_executor().submit(eight_against_one).result()
        raise SystemExit(0)
    if args.int8_inputs:
        kernels = "AVX-512 VNNI" if cpu_kernels.use_avx512() else "AVX2"
        task = (int8_inputs, ("float inputs", f"int8 inputs ({kernels})"), DEFAULT_MODEL, "int4")
    else:
        task = (avx512, ("AVX2", "AVX-512"), SMALL_MODEL, "none")
    single_threaded_torch()  # the main thread stays out of it: the model runs where the server runs it
    compute_executor().submit(main, *task).result()
