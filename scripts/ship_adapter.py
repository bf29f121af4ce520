"""Copy a trained Neurocache adapter into the package, with its floats stored as bfloat16.

    .venv/bin/python -m scripts.ship_adapter runs/nc5/smollm2-135m-instruct [--eval figures.json]

SmolLM2-135M serves in bfloat16 where the CPU or GPU is fast at it, and the adapter is cast
to the model's dtype when it loads, so bfloat16 storage halves the file at no cost there; on a
float32 machine the weights are the bfloat16-rounded ones. Evaluate the shipped copy, not the
run's float32 one. `--eval` adds a JSON object of measured figures to the manifest.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.config import SHIPPED_ADAPTERS
from engine.memories.neurocache.adapter_io import META, WEIGHTS, read_meta


def ship(source: Path, target: Path, figures: dict | None) -> None:
    meta = read_meta(source)
    state = load_file(source / WEIGHTS)
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
    target.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, target / WEIGHTS)
    meta["manifest"]["stored_dtype"] = "bfloat16"
    meta["manifest"]["source"] = str(source)
    if figures is not None:
        meta["manifest"]["eval"] = figures
    (target / META).write_text(json.dumps(meta, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a run's adapter folder (adapter.json + adapter.safetensors)")
    parser.add_argument("--target", type=Path, help="default: engine/adapters/<the source folder's name>")
    parser.add_argument("--eval", type=Path, help="a JSON file of measured figures for the manifest")
    args = parser.parse_args()
    figures = json.loads(args.eval.read_text()) if args.eval else None
    ship(args.source, args.target or SHIPPED_ADAPTERS / args.source.name, figures)


if __name__ == "__main__":
    main()
