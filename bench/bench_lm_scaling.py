"""How cost grows with sequence length: every from-scratch family against the transformer, forward pass.

Each (arch, length) runs in a fresh process so its peak memory is its own: tokens/s (median of
warm runs) and the peak resident memory added by the forward pass. Ratios are against the
transformer at the same length, measured in the same run.

    .venv/bin/python -m bench.bench_lm_scaling [--lengths 1024 2048 4096 8192 16384] [--variants ...]
    .venv/bin/python -m bench.bench_lm_scaling --cache-range 4096   # segment-cache: the cost of a longer reach

The "compiled flex" rows run the fused attention path (research/lms/flex.py) compiled by
torch.compile for CPU, inference only; the compile happens in the warm-up run.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

CACHEFORMER = {"overlap": True, "cache_top_k": 7, "cache_neighbours": 1}
SEGMENT_CACHE = {"segment_len": 64, "memory_len": 128, "cache_segments": 8, "cache_top_k": 2}
VARIANTS = {  # name: (arch, flags, attention kernel)
    "transformer": ("transformer", {}, "math"),
    "long-short": ("long-short", {}, "math"),
    "cacheformer (overlap, k=7, u=1)": ("cacheformer", CACHEFORMER, "math"),
    "long-short, compiled flex": ("long-short", {}, "flex-compiled"),
    "cacheformer, compiled flex": ("cacheformer", CACHEFORMER, "flex-compiled"),
    "segment-cache (l 64, m 128, N 8, k 2)": ("segment-cache", SEGMENT_CACHE, "math"),
    "perceiver-ar (latent 512)": ("perceiver-ar", {"latent": 512}, "math"),
    "perceiver-ar-v1": ("perceiver-ar-v1", {"latent": 512}, "math"),
    "perceiver-ar-v2 (s 256)": ("perceiver-ar-v2", {"latent": 512, "history_segment": 256}, "math"),
    "perceiver-ar-v3 (p 256)": ("perceiver-ar-v3", {"latent": 512, "history_compressed": 256}, "math"),
    "llp (s 256)": ("llp", {"segment_len": 256}, "math"),
}


def measure_one(name: str, length: int, repeats: int) -> dict[str, float]:
    import torch

    from research.lms import build
    from research.training.lm_train import default_model_config

    arch, flags, kernel = VARIANTS[name]
    torch.manual_seed(0)
    model = build(arch, **default_model_config(max_seq_len=length, **flags)).eval()
    if kernel == "flex-compiled":  # the fused path; the warm-up run below compiles it
        from research.lms import flex

        flex.compile_kernels()
        model.use_kernel("flex")
    ids = torch.randint(0, 256, (1, length))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    with torch.inference_mode():
        model(ids)  # warm-up
        for _ in range(repeats):
            started = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"tokens_per_second": length / statistics.median(times), "added_peak_mib": (peak - before) / 1024}


def measure_reach(length: int, segments: int, path: str, repeats: int) -> float:
    """Seconds (median) of one forward at `length` with `segments` cached segments ("window" or
    "gather"), or ("xl") of the cache-free pass whose memory reaches as far: m + N * l."""
    import torch

    from research.lms import build
    from research.training.lm_train import default_model_config

    reach = {**SEGMENT_CACHE, "cache_segments": segments}
    if path == "xl":
        reach = {
            **reach,
            "memory_len": SEGMENT_CACHE["memory_len"] + segments * SEGMENT_CACHE["segment_len"],
            "cache_segments": 2,
        }
    torch.manual_seed(0)
    model = build("segment-cache", **default_model_config(max_seq_len=length, **reach)).eval()
    ids = torch.randint(0, 256, (1, length))
    cache_model: Any = model
    run = (lambda: cache_model.run(model.embed(ids), None)) if path == "xl" else (lambda: cache_model.use_cache_path(path)(ids))
    times = []
    with torch.inference_mode():
        run()
        for _ in range(repeats):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def reach_table(length: int, repeats: int) -> None:
    """The marginal cost of reaching further back: seconds per extra segment of reach."""
    counts = [4, 16, 64]
    l = SEGMENT_CACHE["segment_len"]
    print(
        f"| path (length {length}) | "
        + " | ".join(f"N = {n} (reach {SEGMENT_CACHE['memory_len'] + n * l})" for n in counts)
        + " | ms per extra segment of reach |"
    )
    print("|---|" + "---|" * (len(counts) + 1))
    for path in ("xl", "window", "gather"):
        cmd = [sys.executable, "-m", "bench.bench_lm_scaling", "--reach-one", str(length), path, "--repeats", str(repeats)]
        seconds = []
        for n in counts:
            done = subprocess.run([*cmd, "--segments", str(n)], capture_output=True, text=True, cwd=ROOT, check=True)
            seconds.append(float(done.stdout.strip().splitlines()[-1]))
        marginal = (seconds[-1] - seconds[0]) / (counts[-1] - counts[0]) * 1000
        print(f"| {path} | " + " | ".join(f"{s * 1000:,.0f} ms" for s in seconds) + f" | {marginal:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--one", nargs=2, metavar=("VARIANT", "LENGTH"), help=argparse.SUPPRESS)
    parser.add_argument("--cache-range", type=int, metavar="LENGTH", help="segment-cache: cost of growing N at this length")
    parser.add_argument("--reach-one", nargs=2, metavar=("LENGTH", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--segments", type=int, default=8, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reach_one:
        print(measure_reach(int(args.reach_one[0]), args.segments, args.reach_one[1], args.repeats))
        return
    if args.cache_range:
        reach_table(args.cache_range, args.repeats)
        return
    if args.one:
        print(json.dumps(measure_one(args.one[0], int(args.one[1]), args.repeats)))
        return
    results: dict[tuple[str, int], dict[str, float]] = {}
    for length in args.lengths:
        for name in ["transformer", *(v for v in args.variants if v != "transformer")]:
            cmd = [sys.executable, "-m", "bench.bench_lm_scaling", "--one", name, str(length), "--repeats", str(args.repeats)]
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if done.returncode != 0:
                results[(name, length)] = {"tokens_per_second": float("nan"), "added_peak_mib": float("nan")}
                print(f"{name} at {length}: failed: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
                continue
            results[(name, length)] = json.loads(done.stdout.strip().splitlines()[-1])
    print("| model | length | tokens/s | vs transformer | added peak memory (MiB) | vs transformer |")
    print("|---|---|---|---|---|---|")
    for length in args.lengths:
        base = results[("transformer", length)]
        for name in ["transformer", *(v for v in args.variants if v != "transformer")]:
            r = results[(name, length)]
            print(
                f"| {name} | {length} | {r['tokens_per_second']:,.0f} | {r['tokens_per_second'] / base['tokens_per_second']:.2f}x | "
                f"{r['added_peak_mib']:,.0f} | {r['added_peak_mib'] / max(base['added_peak_mib'], 1e-9):.2f}x |"
            )


if __name__ == "__main__":
    main()
