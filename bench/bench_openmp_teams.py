"""Why the server runs its torch work on one thread (engine/runtime/worker.py): a bfloat16 decode-sized
matmul on a worker thread, timed while another live thread (as the server's event loop is) has
(a) done nothing, (b) run torch work of its own, (c) run the same work after
`single_threaded_torch`. Each case in a fresh process, so one case's OpenMP threads do not linger
into the next. (A thread's OpenMP team goes when the thread ends, so the other thread stays alive
until the timing is done.)

    .venv/bin/python -m bench.bench_openmp_teams
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from engine.runtime.worker import single_threaded_torch

CASES = ("alone", "other thread's torch work", "other thread's torch work, single-threaded")
LINEARS = 60  # two layers' worth of SmolLM2-135M's projections


def other_thread_work(guarded: bool, ready: threading.Event, done: threading.Event) -> None:
    if guarded:
        single_threaded_torch()
    a = torch.randn(1024, 1024)
    (a @ a).sum()
    torch.zeros(4_000_000).add_(1)
    ready.set()
    done.wait()


def linears_ms() -> float:
    weight, x = torch.randn(1536, 576).to(torch.bfloat16), torch.randn(1, 576).to(torch.bfloat16)
    for _ in range(100):
        F.linear(x, weight)
    times = []
    for _ in range(30):
        started = time.perf_counter()
        for _ in range(LINEARS):
            F.linear(x, weight)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def one_case(case: str) -> float:
    single_threaded_torch()  # the main thread stays out of it
    ready, done = threading.Event(), threading.Event()
    thread = threading.Thread(target=other_thread_work, args=(case == CASES[2], ready, done))
    if case != CASES[0]:
        thread.start()
        ready.wait()
    try:
        with ThreadPoolExecutor(max_workers=1) as compute:
            return compute.submit(linears_ms).result()
    finally:
        done.set()


def main() -> None:
    if len(sys.argv) > 1:
        print(one_case(CASES[int(sys.argv[1])]))
        return
    print(
        f"| case | {LINEARS} bfloat16 linears [1 x 576] x [576 x 1536] on the compute thread, ms (median of 30), three processes |"
    )
    print("|---|---|")
    for index, case in enumerate(CASES):
        runs = [
            subprocess.run(
                [sys.executable, "-m", "bench.bench_openmp_teams", str(index)], capture_output=True, text=True, check=True
            )
            for _ in range(3)
        ]
        print(f"| {case} | {', '.join(f'{float(r.stdout):.1f}' for r in runs)} |")


if __name__ == "__main__":
    main()
