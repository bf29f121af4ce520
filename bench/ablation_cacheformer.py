"""CacheFormer ablation: long-short · + overlap · + cache (k, u variants) · + both, same data, same
schedule, same width, several seeds; held-out bits per byte, training tokens/s and peak memory.

    .venv/bin/python -m bench.ablation_cacheformer --steps 300 --seeds 0 1

Prints a Markdown table (mean ± spread over seeds) and writes it to docs/ablation.md, in the section
named after its steps, batch and seeds (the other sections are kept).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from research.evals.docs import write_section

ROOT = Path(__file__).resolve().parents[1]

VARIANTS: dict[str, list[str]] = {
    "long-short": ["--arch", "long-short"],
    "+ overlap": ["--arch", "cacheformer", "--overlap"],
    "+ cache (k 7, u 1)": ["--arch", "cacheformer", "--cache-top-k", "7", "--cache-neighbours", "1"],
    "+ cache (k 3, u 3)": ["--arch", "cacheformer", "--cache-top-k", "3", "--cache-neighbours", "3"],
    "+ both (k 7, u 1)": ["--arch", "cacheformer", "--overlap", "--cache-top-k", "7", "--cache-neighbours", "1"],
}
PAPER = {  # WikiText-103 perplexity, 122.5M parameters, as the CacheFormer paper reports
    "long-short": "23.74",
    "+ both (k 7, u 1)": "21.32",
}


def run(name: str, seed: int, args: argparse.Namespace) -> dict:
    out = ROOT / "runs" / "ablation" / f"{name.replace(' ', '_').replace('(', '').replace(')', '').replace(',', '')}-s{seed}"
    cmd = [
        sys.executable,
        "-m",
        "clients.cli",
        "train",
        "lm",
        *VARIANTS[name],
        "--steps",
        str(args.steps),
        "--seed",
        str(seed),
        "--out",
        str(out),
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--warmup",
        str(args.warmup),
        "--lr",
        str(args.lr),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed:\n{done.stderr[-2000:]}")
    return json.loads((out / "summary.json").read_text())


def spread(values: list[float]) -> str:
    mean = statistics.mean(values)
    half = (max(values) - min(values)) / 2
    return f"{mean:.4f} ± {half:.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    args = parser.parse_args()
    rows = []
    for name in args.variants:
        results = [run(name, seed, args) for seed in args.seeds]
        print(f"{name}: {[round(r['heldout_bits_per_byte'], 4) for r in results]}", flush=True)
        rows.append((name, results))
    base = statistics.mean(r["heldout_bits_per_byte"] for r in rows[0][1])
    lines = [
        "| variant | parameters | held-out bits/byte (mean ± half-range) | vs long-short | train tokens/s | peak RSS (MiB) | paper (WikiText-103 ppl) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, results in rows:
        bpb = [r["heldout_bits_per_byte"] for r in results]
        lines.append(
            f"| {name} | {results[0]['parameters']:,} | {spread(bpb)} | {statistics.mean(bpb) - base:+.4f} | "
            f"{statistics.mean(r['train_tokens_per_second'] for r in results):,.0f} | "
            f"{max(r['peak_rss_mib'] for r in results):,.0f} | {PAPER.get(name, '—')} |"
        )
    table = "\n".join(lines)
    print(table)
    command = "python -m bench.ablation_cacheformer " + " ".join(sys.argv[1:])
    seeds = " ".join(str(seed) for seed in args.seeds)
    section = (
        f"## {args.steps} steps of {args.batch_size} × {args.seq_len} bytes, seeds {seeds}\n\n"
        f"Command:\n\n```\n{command.strip()}\n```\n\nSame schedule and data for every variant; held-out bits per byte on "
        "the first 64 KiB of the held-out split. Peak RSS is the training process's maximum resident memory.\n\n" + table + "\n"
    )
    write_section(ROOT / "docs" / "ablation.md", section, title="# CacheFormer ablation (byte-level, offline corpus)")


if __name__ == "__main__":
    main()
