"""Every from-scratch family at one parameter count: transformer, long-short, CacheFormer and its
ablations, segment-cache, Perceiver AR and its V1/V2/V3, LLP. Same data, schedule and steps; each
family's width is the one that brings its parameter count closest to the transformer's.

    .venv/bin/python -m bench.ablation_families --steps 400 --seeds 0 1 [--jobs 2]

Every model is scored on the same held-out bytes: windows of seq_len every `latent` bytes, each
scoring its last `latent` positions (a Perceiver predicts only those). Writes one section of
docs/ablation.md per setting: mean ± half-range over seeds, the gap to the transformer, and whether
the ordering is settled (each gap to the next family larger than 3× the larger seed spread), with
every run's curve (held-out bits/byte at each checkpoint) under runs/families/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.ablation_cacheformer import spread
from research.evals.docs import write_section

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN, LATENT = 512, 256
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {  # name: (arch, LMConfig flags)
    "transformer": ("transformer", {}),
    "long-short": ("long-short", {}),
    "cacheformer + overlap": ("cacheformer", {"overlap": True}),
    "cacheformer + cache (k 7, u 1)": ("cacheformer", {"cache_top_k": 7}),
    "cacheformer + cache (k 3, u 3)": ("cacheformer", {"cache_top_k": 3, "cache_neighbours": 3}),
    "cacheformer (overlap, k 7, u 1)": ("cacheformer", {"overlap": True, "cache_top_k": 7}),
    "segment-cache (l 32, m 64, N 8, k 2)": (
        "segment-cache",
        {"segment_len": 32, "memory_len": 64, "cache_segments": 8, "cache_top_k": 2},
    ),
    "perceiver-ar": ("perceiver-ar", {"latent": LATENT}),
    "perceiver-ar-v1": ("perceiver-ar-v1", {"latent": LATENT}),
    "perceiver-ar-v2 (s 64)": ("perceiver-ar-v2", {"latent": LATENT, "history_segment": 64}),
    "perceiver-ar-v3 (p 64)": ("perceiver-ar-v3", {"latent": LATENT, "history_compressed": 64}),
    "llp (s 256)": ("llp", {"segment_len": 256}),
}
FLAG_NAMES = {  # LMConfig field -> `longdoc train lm` option
    "overlap": "--overlap",
    "cache_top_k": "--cache-top-k",
    "cache_neighbours": "--cache-neighbours",
    "segment_len": "--segment-len",
    "memory_len": "--memory-len",
    "cache_segments": "--cache-segments",
    "latent": "--latent",
    "history_segment": "--history-segment",
    "history_compressed": "--history-compressed",
}


def parameters(arch: str, flags: dict[str, Any], dim: int) -> int:
    from research.lms import build
    from research.training.lm_train import default_model_config

    return build(arch, **default_model_config(**flags, dim=dim, max_seq_len=SEQ_LEN)).num_parameters()


def matched_dim(arch: str, flags: dict[str, Any], target: int) -> int:
    """The width (a multiple of 8: 4 heads of an even size) whose parameter count is nearest `target`."""
    return min(range(64, 257, 8), key=lambda dim: abs(parameters(arch, flags, dim) - target))


def command(name: str, dim: int, seed: int, args: argparse.Namespace) -> tuple[list[str], Path]:
    arch, flags = FAMILIES[name]
    # relative: the run's cwd is ROOT, and its recorded command names no local folder
    out = Path("runs") / "families" / f"{re.sub('[^a-z0-9]+', '-', name).strip('-')}-d{dim}-n{args.steps}-s{seed}"
    cmd = [sys.executable, "-m", "clients.cli", "train", "lm", "--arch", arch, "--dim", str(dim), "--out", str(out)]
    for field, value in flags.items():
        cmd += [FLAG_NAMES[field]] if value is True else [FLAG_NAMES[field], str(value)]
    cmd += ["--steps", str(args.steps), "--seed", str(seed), "--seq-len", str(SEQ_LEN), "--batch-size", str(args.batch_size)]
    cmd += ["--lr", str(args.lr), "--warmup", str(args.warmup), "--eval-scored", str(LATENT)]
    cmd += ["--checkpoint-every", str(max(1, args.steps // 4))]
    return cmd, ROOT / out


def run(name: str, dim: int, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd, out = command(name, dim, seed, args)
    if args.reuse and (out / "summary.json").is_file() and (out / "command.json").is_file():
        if json.loads((out / "command.json").read_text()) == cmd[1:]:  # the same run, finished
            return finished(name, seed, out)
    (out / "curve.jsonl").unlink(missing_ok=True)  # a rerun starts its curve again
    (out / "summary.json").unlink(missing_ok=True)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed:\n{done.stderr[-2000:]}")
    (out / "command.json").write_text(json.dumps(cmd[1:]))
    return finished(name, seed, out)


def finished(name: str, seed: int, out: Path) -> dict[str, Any]:
    summary = json.loads((out / "summary.json").read_text())
    summary["curve"] = [json.loads(line)["heldout_bits_per_byte"] for line in (out / "curve.jsonl").read_text().splitlines()]
    print(f"{name} seed {seed}: {summary['heldout_bits_per_byte']:.4f}", flush=True)
    return summary


def settled(rows: list[tuple[str, list[dict[str, Any]]]]) -> list[str]:
    """For neighbours in the ranking: is the gap more than 3x the larger half-range of the two?"""
    ranked = sorted(rows, key=lambda row: statistics.mean(r["heldout_bits_per_byte"] for r in row[1]))
    notes = []
    for (a, ra), (b, rb) in zip(ranked, ranked[1:], strict=False):
        bpb_a, bpb_b = ([r["heldout_bits_per_byte"] for r in rs] for rs in (ra, rb))
        gap = statistics.mean(bpb_b) - statistics.mean(bpb_a)
        noise = max((max(bpb_a) - min(bpb_a)) / 2, (max(bpb_b) - min(bpb_b)) / 2)
        notes.append(f"{a} < {b}: gap {gap:.4f}, {'settled' if gap > 3 * noise else 'not settled'} (3× spread {3 * noise:.4f})")
    return notes


def table(rows: list[tuple[str, list[dict[str, Any]]]], dims: dict[str, int]) -> str:
    base = statistics.mean(r["heldout_bits_per_byte"] for r in rows[0][1])
    lines = [
        "| family | width | parameters | held-out bits/byte (mean ± half-range) | vs transformer "
        "| curve (mean at each quarter) | bytes seen | targets trained | train s (mean) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, results in rows:
        bpb = [r["heldout_bits_per_byte"] for r in results]
        curve = " → ".join(f"{statistics.mean(points):.3f}" for points in zip(*(r["curve"] for r in results), strict=True))
        lines.append(
            f"| {name} | {dims[name]} | {results[0]['parameters']:,} | {spread(bpb)} | {statistics.mean(bpb) - base:+.4f} | "
            f"{curve} | {results[0]['train_tokens']:,} | {results[0]['train_targets']:,} | "
            f"{statistics.mean(r['train_seconds'] for r in results):,.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs of the same command")
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--heading", default="Every family", help="names the section, so a run of some families keeps the others")
    args = parser.parse_args()
    names = ["transformer", *(n for n in args.families if n != "transformer")]
    target = parameters("transformer", {}, 128)
    dims = {name: matched_dim(*FAMILIES[name], target) for name in names}
    jobs = [(name, seed) for name in names for seed in args.seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        done = list(pool.map(lambda job: run(job[0], dims[job[0]], job[1], args), jobs))
    rows = [(name, [r for (n, _), r in zip(jobs, done, strict=True) if n == name]) for name in names]
    body = table(rows, dims) + "\n\nOrdering, neighbour by neighbour:\n\n" + "\n".join(f"- {note}" for note in settled(rows))
    print(body)
    seeds = " ".join(str(seed) for seed in args.seeds)
    section = (
        f"## {args.heading} at {target:,} parameters: {args.steps} steps of {args.batch_size} × {SEQ_LEN} bytes, seeds {seeds}\n\n"
        f"Command:\n\n```\n.venv/bin/python -m bench.ablation_families {shlex.join(sys.argv[1:])}\n```\n\n"
        f"Held-out bits/byte on the first 64 KiB of the held-out split, windows of {SEQ_LEN} every {LATENT} bytes scoring "
        f"their last {LATENT} (the same bytes for every family). Runs went {args.jobs} at a time, one thread each.\n\n"
        + body
        + "\n"
    )
    write_section(ROOT / "docs" / "ablation.md", section, title="# CacheFormer ablation (byte-level, offline corpus)")


if __name__ == "__main__":
    main()
