"""Two builds of the CPU kernels' sources (engine/models/csrc/), the AVX2 int4 matmul on int8
inputs alternating in one process: first checks that both give the same bits, then medians of 15
rounds of each for 1, 2, 4 and 8 rows over random weights of the default model's projection
shapes. The AVX2 kernels run on any CPU with AVX2, AVX-512 ones too.

    mkdir /tmp/old && for f in weight_only.c weight_only.h decode_step.c; do
      git show 3825248:engine/models/csrc/$f > /tmp/old/$f; done
    .venv/bin/python -m bench.bench_int4_builds /tmp/old engine/models/csrc
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from engine.models.cpu_kernels import FLAGS
from engine.models.quantize import int4_groups
from engine.runtime.worker import compute_executor, single_threaded_torch

SHAPES = ((1536, 8960), (8960, 1536), (1536, 1536), (1536, 256))  # (in, out): MLP up and down, attention
ROUNDS, CALLS = 15, 3


def build(sources: Path, target: Path) -> ctypes.CDLL:
    files = [str(sources / name) for name in ("weight_only.c", "decode_step.c")]
    subprocess.run([os.environ.get("CC", "cc"), *FLAGS, *files, "-o", str(target), "-lm"], check=True)
    lib = ctypes.CDLL(str(target))
    pointer, size = ctypes.c_void_p, ctypes.c_long
    lib.int4_matmul.argtypes = [pointer, size, size, pointer, pointer, size, pointer]
    lib.matmul_int8_inputs.argtypes = lib.matmul_avx512.argtypes = [size]
    lib.matmul_int8_inputs(1)
    lib.matmul_avx512(0)
    return lib


def product(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], packed.shape[0])
    lib.int4_matmul(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), groups.data_ptr(), packed.shape[0], out.data_ptr())
    return out


def compare(old: ctypes.CDLL, new: ctypes.CDLL) -> None:
    torch.manual_seed(0)
    weights = [int4_groups(torch.randn(out, features) * 0.02) for features, out in SHAPES]
    print("| rows | old ms | new ms | new / old |\n|---|---|---|---|")
    for rows in (1, 2, 4, 8):
        inputs = [torch.randn(rows, features) for features, _ in SHAPES]
        for x, (packed, groups) in zip(inputs, weights, strict=True):
            assert torch.equal(product(old, x, packed, groups), product(new, x, packed, groups)), (rows, x.shape)
        times: dict[int, list[float]] = {0: [], 1: []}
        for _ in range(ROUNDS + 1):  # the first round warms up
            for index, lib in enumerate((old, new)):
                started = time.perf_counter()
                for x, (packed, groups) in zip(inputs, weights, strict=True):
                    for _ in range(CALLS):
                        product(lib, x, packed, groups)
                times[index].append(time.perf_counter() - started)
        before, after = statistics.median(times[0][1:]), statistics.median(times[1][1:])
        print(f"| {rows} | {before * 1e3:.2f} | {after * 1e3:.2f} | {after / before:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path, help="a folder with the old weight_only.c, weight_only.h and decode_step.c")
    parser.add_argument("new", type=Path, help="the same for the new build")
    args = parser.parse_args()
    single_threaded_torch()  # the compute thread's OpenMP team owns the cores, as in the server
    with tempfile.TemporaryDirectory() as scratch:
        old, new = build(args.old, Path(scratch) / "old.so"), build(args.new, Path(scratch) / "new.so")
        compute_executor().submit(compare, old, new).result()


if __name__ == "__main__":
    main()
