"""Two builds of the CPU kernels' sources (engine/models/csrc/), the int4 matmul alternating in
one process: first checks that both give the same bits, then medians of 15 rounds of each for 1, 2,
4 and 8 rows over random weights of the default model's projection shapes. By default the AVX2
kernel on int8 inputs over one of each shape (19 MB: read from L3); `--avx512` the AVX-512
kernels (VNNI where the CPU has it), `--float-inputs` int4 and int8 on float32 inputs, `--layers 28` the
fused projections of 28 layers (0.82 GB, read from memory as a decode step reads them), `--head`
the int8 output head [151,936 x 1,536] alone (on a CPU with AVX-512 VNNI, `--avx512` rounds its inputs
as int4's, since 2026-11-30).
`--other-numbers` where the builds compute differently (int8 on int8 inputs against float32 ones):
the largest difference is printed instead of equal bits required.

    mkdir /tmp/old && for f in weight_only.c weight_only.h decode_step.c; do
      git show 3825248:engine/models/csrc/$f > /tmp/old/$f; done
    .venv/bin/python -m bench.bench_int4_builds /tmp/old engine/models/csrc
    .venv/bin/python -m bench.bench_int4_builds /tmp/old engine/models/csrc --avx512 --layers 28
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.models.cpu_kernels import FLAGS
from engine.models.quantize import int4_groups, int8_rows
from engine.runtime.worker import compute_executor, single_threaded_torch

SHAPES = ((1536, 8960), (8960, 1536), (1536, 1536), (1536, 256))  # (in, out): MLP up and down, attention
LAYER = ((1536, 2048), (1536, 1536), (1536, 17920), (8960, 1536))  # a layer's fused q/k/v, o, gate/up, down
HEAD = (1536, 151936)
ROUNDS, CALLS = 15, 3


@dataclass(frozen=True)
class Setup:
    avx512: bool
    int8_inputs: bool


@dataclass(frozen=True)
class Weight:
    """One weight the timed calls multiply by: int4 (codes, groups) or int8 (weight, scales)."""

    features: int
    data: torch.Tensor
    scales: torch.Tensor
    int8: bool = False


def build(sources: Path, target: Path, setup: Setup) -> ctypes.CDLL:
    files = [str(sources / name) for name in ("weight_only.c", "decode_step.c")]
    subprocess.run([os.environ.get("CC", "cc"), *FLAGS, *files, "-o", str(target), "-lm"], check=True)
    lib = ctypes.CDLL(str(target))
    pointer, size = ctypes.c_void_p, ctypes.c_long
    for kernel in (lib.int4_matmul, lib.int8_matmul):
        kernel.argtypes = [pointer, size, size, pointer, pointer, size, pointer]
    lib.matmul_int8_inputs.argtypes = lib.matmul_avx512.argtypes = [size]
    lib.matmul_int8_inputs(int(setup.int8_inputs))
    assert lib.matmul_avx512(int(setup.avx512)) == setup.avx512, "no AVX-512 (F, BW, VL) on this CPU"
    return lib


def product(lib: ctypes.CDLL, x: torch.Tensor, weight: Weight) -> torch.Tensor:
    out = torch.empty(x.shape[0], weight.data.shape[0])
    kernel = lib.int8_matmul if weight.int8 else lib.int4_matmul
    kernel(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        weight.data.data_ptr(),
        weight.scales.data_ptr(),
        weight.data.shape[0],
        out.data_ptr(),
    )
    return out


def random_weights(layers: int, head: bool) -> list[Weight]:
    """Random weights of the shapes asked for, each quantized as `--quantize int4` stores it."""
    torch.manual_seed(0)
    if head:
        return [Weight(HEAD[0], *int8_rows(torch.randn(HEAD[1], HEAD[0]) * 0.02), int8=True)]
    shapes = [shape for _ in range(layers) for shape in LAYER] if layers else list(SHAPES)
    return [Weight(features, *int4_groups(torch.randn(out, features) * 0.02)) for features, out in shapes]


def compare(old: ctypes.CDLL, new: ctypes.CDLL, weights: list[Weight], calls: int, other_numbers: bool) -> None:
    counts = (1, 2, 4, 8)
    inputs = {rows: {w.features: torch.randn(rows, w.features) for w in weights} for rows in counts}
    for rows in counts:
        for weight in weights[: len(SHAPES)]:
            x = inputs[rows][weight.features]
            a, b = product(old, x, weight), product(new, x, weight)
            if other_numbers:
                share = float((a - b).abs().max() / a.abs().max())
                print(f"rows {rows}, in {x.shape[1]}: largest difference / largest output {share:.2e}")
            else:
                assert torch.equal(a, b), (rows, x.shape)
    print("| rows | old ms | new ms | new / old |\n|---|---|---|---|")
    for rows in counts:
        times: dict[int, list[float]] = {0: [], 1: []}
        for _ in range(ROUNDS + 1):  # the first round warms up
            for index, lib in enumerate((old, new)):
                started = time.perf_counter()
                for weight in weights:
                    for _ in range(calls):
                        product(lib, inputs[rows][weight.features], weight)
                times[index].append(time.perf_counter() - started)
        before, after = statistics.median(times[0][1:]), statistics.median(times[1][1:])
        print(f"| {rows} | {before * 1e3:.2f} | {after * 1e3:.2f} | {after / before:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path, help="a folder with the old weight_only.c, weight_only.h and decode_step.c")
    parser.add_argument("new", type=Path, help="the same for the new build")
    parser.add_argument("--avx512", action="store_true", help="the AVX-512 kernels (VNNI where the CPU has it)")
    parser.add_argument("--float-inputs", action="store_true", help="int4 and int8 on float32 inputs, not rounded to int8")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--layers", type=int, default=0, help="the projections of this many layers (0: one of each shape)")
    sizes.add_argument("--head", action="store_true", help="the int8 output head instead")
    parser.add_argument(
        "--other-numbers", action="store_true", help="the builds compute differently: report, do not require, equal bits"
    )
    args = parser.parse_args()
    setup = Setup(args.avx512, not args.float_inputs)
    weights = random_weights(args.layers, args.head)
    print(
        f"{len(weights)} weights, {sum(w.data.numel() + w.scales.numel() * w.scales.element_size() for w in weights) / 1e9:.3f} GB, {setup}"
    )
    single_threaded_torch()  # the compute thread's OpenMP team owns the cores, as in the server
    with tempfile.TemporaryDirectory() as scratch:
        old, new = build(args.old, Path(scratch) / "old.so", setup), build(args.new, Path(scratch) / "new.so", setup)
        int8_rounds = getattr(new, "int8_rounds_inputs", lambda: 0)()  # a build before 621ce5b has none
        rounds = f"int4 {bool(new.int4_rounds_inputs())}, int8 {bool(int8_rounds)}"
        print(f"the new build rounds its inputs to int8: {rounds}")
        calls = 1 if args.layers or args.head else CALLS  # from memory: each weight once a round
        compute_executor().submit(compare, old, new, weights, calls, args.other_numbers).result()


if __name__ == "__main__":
    main()
