"""The QA benchmark's texts: held-out public-domain books from package registries, one per genre;
and the development texts its settings are chosen on (DEV_TEXTS).

Three come from the project corpus (research/training/corpus.py, never trained on: HELD_OUT there);
two come from Debian packages that no training run reads. Each is cut to whole units (books,
lexicon letters) so that it holds 30K-130K tokens of SmolLM2-135M.

    .venv/bin/python -m research.evals.texts     # fetch and print each text's size
"""

from __future__ import annotations

import gzip
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.config import operator_cache_dir
from research.training.corpus import DEFAULT_DIR, HELD_OUT, fetch

QA_DIR = Path("data/qa")


@dataclass(frozen=True)
class QaText:
    name: str
    genre: str
    source: str  # a corpus file name, or "debian:<package>:<path inside the package>"
    start: str | None = None  # the text begins at the first line holding this (inclusive)
    end: str | None = None  # and ends before the first line after `start` holding this


TEXTS = (
    QaText("alice", "novel", "alice29.txt"),
    QaText("paradise-lost", "poem", "plrabn12.txt", end="Book XII"),
    QaText("acts", "scripture and history", "kjv-Acts.txt"),
    QaText(
        "jargon",
        "technical reference",
        "debian:jargon-text:usr/share/doc/jargon-text/jargon.txt.gz",
        start="   :(TM):",
        end="   :daemon:",
    ),
    QaText(
        "devil",
        "reference (dictionary)",
        "debian:dict-devil:usr/share/dictd/devil.dict.dz",
        start="THE DEVIL'S DICTIONARY",
        end=" abcdefghijklmnopqrstuvwxyz",
    ),
)
# Development texts (research/evals/qa_dev.jsonl): settings are chosen on their questions, never on
# the held-out ones above. They are in the training split (the Neurocache adapter and the research
# models read them), so they rank settings of retrieval and prompting, not of trained models.
DEV_TEXTS = (
    QaText("asyoulik", "play", "asyoulik.txt"),
    QaText("lcet10", "technical report", "lcet10.txt"),
    QaText("genesis", "scripture", "kjv-Genesis.txt"),
)
BY_NAME = {t.name: t for t in TEXTS + DEV_TEXTS}


def _debian_file(package: str, member: str, into: Path) -> bytes:
    subprocess.run(["apt-get", "download", "-q", package], cwd=into, check=True, capture_output=True)
    deb = next(into.glob(f"{package}_*.deb"))
    subprocess.run(["dpkg-deb", "-x", str(deb), str(into / "x")], check=True)
    data = (into / "x" / member).read_bytes()
    return gzip.decompress(data) if member.endswith((".gz", ".dz")) else data


def _cut(text: str, start: str | None, end: str | None) -> str:
    lines = text.splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if start in line) if start else 0
    last = next((i for i, line in enumerate(lines[first + 1 :], first + 1) if end in line), len(lines)) if end else len(lines)
    return "".join(lines[first:last]).strip() + "\n"


def raw(spec: QaText, corpus_dir: Path = DEFAULT_DIR) -> str:
    if not spec.source.startswith("debian:"):
        assert spec in DEV_TEXTS or spec.source in HELD_OUT, f"{spec.source} is in the training split"
        return (fetch(corpus_dir) / spec.source).read_text(encoding="utf-8")
    _, package, member = spec.source.split(":", 2)
    with tempfile.TemporaryDirectory() as tmp:
        return _debian_file(package, member, Path(tmp)).decode("utf-8")


def load(name: str, qa_dir: Path = QA_DIR, corpus_dir: Path = DEFAULT_DIR) -> str:
    """The text `name` as the benchmark uses it (fetched and cut once, then read from `qa_dir`)."""
    return load_spec(BY_NAME[name], qa_dir, corpus_dir)


def load_spec(spec: QaText, qa_dir: Path = QA_DIR, corpus_dir: Path = DEFAULT_DIR) -> str:
    path = qa_dir / f"{spec.name}.txt"
    if not path.exists():
        qa_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(_cut(raw(spec, corpus_dir), spec.start, spec.end), encoding="utf-8")
    return path.read_text(encoding="utf-8")


if __name__ == "__main__":
    from transformers import AutoTokenizer

    from engine.models.loader import small_model_dir

    tokenizer = AutoTokenizer.from_pretrained(small_model_dir(operator_cache_dir()))
    for spec in TEXTS:
        text = load(spec.name)
        print(f"{spec.name:14} {spec.genre:24} {len(text):>8} chars {len(tokenizer(text)['input_ids']):>7} tokens")
