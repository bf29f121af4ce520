"""Fetch the public-domain long texts named in DESIGN.md from PyPI (no other network is used).

The Canterbury corpus ships inside the `brotli` source distribution: alice29.txt, asyoulik.txt,
lcet10.txt and plrabn12.txt (Paradise Lost, about 132k tokens for the default model's tokenizer).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

CANTERBURY = ("alice29.txt", "asyoulik.txt", "lcet10.txt", "plrabn12.txt")
BROTLI_SDIST = "brotli==1.2.1"


def fetch(target: Path) -> list[Path]:
    target.mkdir(parents=True, exist_ok=True)
    wanted = [target / name for name in CANTERBURY]
    if all(p.exists() for p in wanted):
        return wanted
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary=:all:", BROTLI_SDIST, "-d", tmp],
            check=True,
        )
        archive = next(Path(tmp).glob("*.tar.gz"))
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if name in CANTERBURY and "/testdata/" in member.name:
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                    (target / name).write_bytes(data.replace(b"\r\n", b"\n"))
    return wanted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", type=Path, default=Path("data/corpus"))
    for path in fetch(parser.parse_args().target):
        print(f"{path}  {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
