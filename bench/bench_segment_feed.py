"""CacheFormer fed past its training length: held-out bits per byte with the whole history (fed
segment by segment through the model's own state) against a sliding window of the training length,
by position, and the feeding cost as the history grows.

    .venv/bin/python -m bench.bench_segment_feed --bytes 32768

Prints Markdown tables and writes them to docs/segment_feed.md, in the section named after the
checkpoint and the byte count (the other sections are kept).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from research.evals.docs import write_section
from research.lms.lm_io import load_checkpoint
from research.plugin import SHIPPED_CHECKPOINTS
from research.training.corpus import fetch, split
from research.training.lm_eval import fed_losses, sliding_losses

ROOT = Path(__file__).resolve().parents[1]

BITS = 1 / math.log(2)


def buckets(limit: int, context: int) -> list[tuple[int, int]]:
    edges = [0, context, 4 * context, 16 * context, 64 * context]
    edges = [e for e in edges if e < limit] + [limit]
    return list(zip(edges[:-1], edges[1:], strict=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=SHIPPED_CHECKPOINTS / "cacheformer-bytes")
    parser.add_argument("--bytes", type=int, default=32_768, help="bytes of each held-out document")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "segment_feed.md", help="Markdown file to write")
    args = parser.parse_args()
    model = load_checkpoint(args.checkpoint)
    context = model.config.max_seq_len
    _, held_out = split(fetch(ROOT / "data" / "corpus"))
    per_doc, sliding_all, fed_all, costs = [], [], [], []
    for path in held_out:
        data = np.frombuffer(path.read_bytes(), dtype=np.uint8)[: args.bytes]
        started = time.perf_counter()
        sliding = sliding_losses(model, data, context)
        sliding_seconds = time.perf_counter() - started
        fed, seconds, nbytes = fed_losses(model, data)
        per_doc.append((path.name, len(data), sliding.mean() * BITS, fed.mean() * BITS))
        sliding_all.append(sliding)
        fed_all.append(fed)
        costs.append((path.name, len(data), seconds, nbytes, sliding_seconds))
        print(per_doc[-1], flush=True)
    lines = [
        f"Checkpoint `{args.checkpoint.relative_to(ROOT) if args.checkpoint.is_relative_to(ROOT) else args.checkpoint}`"
        f" ({model.arch}, {model.num_parameters():,} parameters, trained on {context}-byte sequences). Held-out"
        f" documents, first {args.bytes:,} bytes each; CPU, {torch.get_num_threads()} threads.\n",
        "| document | bytes | sliding window of the training length (bits/byte) | fed whole history (bits/byte) | fed − sliding |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {n} | {b:,} | {s:.4f} | {t:.4f} | {t - s:+.4f} |" for n, b, s, t in per_doc]
    lines += [
        "",
        "By position in the document (all documents pooled):",
        "",
        "| bytes before the scored byte | sliding (bits/byte) | fed (bits/byte) | fed − sliding |",
        "|---|---|---|---|",
    ]
    for lo, hi in buckets(args.bytes - 1, context):
        s = np.concatenate([x[lo:hi] for x in sliding_all]).mean() * BITS
        t = np.concatenate([x[lo:hi] for x in fed_all]).mean() * BITS
        lines.append(f"| {lo:,}–{hi:,} | {s:.4f} | {t:.4f} | {t - s:+.4f} |")
    lines += [
        "",
        "Feeding cost (chunks of 1,024 bytes; the rate over the last chunk shows how the cost grows with the history):",
        "",
        "| document | fed bytes/s, whole | bytes/s over the last chunk | sliding-window bytes/s | state bytes per byte of history |",
        "|---|---|---|---|---|",
    ]
    for name, size, seconds, nbytes, sliding_seconds in costs:
        last = 1024 / (seconds[-1] - seconds[-2]) if len(seconds) > 1 else float("nan")
        lines.append(
            f"| {name} | {size / seconds[-1]:,.0f} | {last:,.0f} | {size / sliding_seconds:,.0f} | {nbytes / size:,.0f} |"
        )
    table = "\n".join(lines)
    print(table)
    command = "python -m bench.bench_segment_feed " + " ".join(sys.argv[1:])
    section = f"## {args.checkpoint.name}, first {args.bytes:,} bytes of each document\n\nCommand:\n\n```\n{command.strip()}\n```\n\n{table}\n"
    write_section(args.out, section, title="# CacheFormer past its training length (fed segment by segment)")


if __name__ == "__main__":
    main()
