"""Fetch the offline public-domain corpus (see research/training/corpus.py) into data/corpus."""

from __future__ import annotations

import argparse
from pathlib import Path

from research.training.corpus import DEFAULT_DIR, fetch, split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", type=Path, default=DEFAULT_DIR)
    target = fetch(parser.parse_args().target)
    train, held = split(target)
    print(f"{len(train)} training files, {sum(f.stat().st_size for f in train)} bytes")
    print(f"{len(held)} held-out files: {', '.join(f.name for f in held)}")


if __name__ == "__main__":
    main()
