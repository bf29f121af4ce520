"""Exact kNN backends (engine/memories/neurocache/knn.py) timed against each other on the same rows.

For each database size: random float32 rows of a memory's width (Neurocache's compressed states,
the text memory's sentence vectors), queried by one row (a decode step) and by a segment's worth
of rows; FAISS on CPU against torch on CUDA where there is a GPU (FAISS GPU where the installed
faiss has it). Reports the median time per call and the share of each query's k neighbours the
backends agree on (float32 on both sides; ties and near-ties at the k-th place can differ).

    python3 -m bench.bench_knn --sizes 16384 131072 1048576
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.memories.neurocache.knn import FaissCpuKnn, FaissGpuKnn, KnnBackend, TorchKnn, faiss_has_gpu


def timed(backend: KnnBackend, database: torch.Tensor, queries: torch.Tensor, k: int, repeats: int) -> tuple[float, torch.Tensor]:
    backend.search(database, queries, k)  # warm-up
    times = []
    for _ in range(repeats):
        if database.is_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        _, rows = backend.search(database, queries, k)
        if database.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times), rows.cpu()


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    same = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b, strict=True))
    return same / a.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16_384, 131_072, 1_048_576])
    parser.add_argument("--dims", type=int, nargs="+", default=[256, 384])
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    backends: list[tuple[KnnBackend, str]] = [(FaissCpuKnn(), "cpu")]
    if torch.cuda.is_available():
        backends.append((FaissGpuKnn() if faiss_has_gpu() else TorchKnn(), "cuda"))
    names = [f"{b.name} ({device})" for b, device in backends]
    print(f"| rows | width | queries | k | {' | '.join(f'{n} ms' for n in names)} | neighbours agreeing |")
    print("|---|---|---|---|" + "---|" * len(names) + "---|")
    generator = torch.Generator().manual_seed(0)
    for dim in args.dims:
        for size in args.sizes:
            database = torch.randn(size, dim, generator=generator)
            for count in args.queries:
                queries = torch.randn(count, dim, generator=generator)
                results = [timed(b, database.to(d), queries.to(d), args.k, args.repeats) for b, d in backends]
                times = " | ".join(f"{seconds * 1000:.2f}" for seconds, _ in results)
                agree = f"{agreement(results[0][1], results[-1][1]):.4f}" if len(results) > 1 else "one backend"
                print(f"| {size:,} | {dim} | {count} | {args.k} | {times} | {agree} |", flush=True)


if __name__ == "__main__":
    main()
