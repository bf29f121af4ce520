"""Real documents for the parsers' figures: manuals that Debian packages ship as PDF, EPUB, HTML and
Word files, pinned by package version and checked by SHA-256 (`make documents` fetches them into
data/documents). Two manuals come in two formats each, so one extraction can be checked against
the other: the Bash reference (PDF and HTML) and the Debian Developer's Reference (PDF and EPUB)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

DOCUMENTS_DIR = Path("data/documents")


@dataclass(frozen=True)
class RealFile:
    name: str
    package: str
    version: str
    member: str  # the path inside the package
    sha256: str


REAL_FILES = (
    RealFile(
        "bashref.pdf",
        "bash-doc",
        "5.2.15-2",
        "usr/share/doc/bash/bashref.pdf",
        "104971d389c0b9b7a261b0b3070a53b0d8cce6db1ffddefcc8423ddda92acd87",
    ),
    RealFile(
        "bashref.html",
        "bash-doc",
        "5.2.15-2",
        "usr/share/doc/bash/bashref.html",
        "572c0a2b543bc0cb57ae5bd32345c3c8f477672b1180ad01a5eece45abf414e0",
    ),
    RealFile(
        "developers-reference.pdf",
        "developers-reference",
        "12.18",
        "usr/share/developers-reference/developers-reference.pdf",
        "88e5ac4d15444fd3adb821dc863bd91b820e99a27e65728e74975ab1752652f5",
    ),
    RealFile(
        "developers-reference.epub",
        "developers-reference",
        "12.18",
        "usr/share/developers-reference/developers-reference.epub",
        "415d6a1e351e5f72f85bc9428908a55a47b05a15422bbe962a9a963d04467d41",
    ),
    RealFile(
        "debian-reference.pdf",
        "debian-reference-en",
        "2.100",
        "usr/share/debian-reference/debian-reference.en.pdf",
        "32775deeca0770ac25282b0c894cbaae83f4dd4ab00e891b94e8f009c0366728",
    ),
    RealFile(
        "gnuplot.pdf",
        "gnuplot-doc",
        "5.4.4+dfsg1-2",
        "usr/share/doc/gnuplot/gnuplot.pdf",
        "df68dd0613f043141512fc4436d17aaf96727d5a758d85233915ac5056a97206",
    ),
    RealFile(
        "officer-example.docx",
        "r-cran-officer",
        "0.6.0+dfsg-1",
        "usr/lib/R/site-library/officer/doc_examples/example.docx",
        "cf22eda5ca1cd378df4ef506d9e0ecd31b407a21077c6a10ae3f20d12db324ab",
    ),
)
PAIRS = (("bashref.pdf", "bashref.html"), ("developers-reference.pdf", "developers-reference.epub"))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch(into: Path = DOCUMENTS_DIR) -> dict[str, Path]:
    """Each file, downloaded with `apt-get download` once and checked; raises when a hash differs."""
    into.mkdir(parents=True, exist_ok=True)
    paths = {}
    for package in dict.fromkeys(f.package for f in REAL_FILES):
        wanted = [f for f in REAL_FILES if f.package == package and not _good(into / f.name, f.sha256)]
        if wanted:
            _download(package, wanted[0].version, wanted, into)
    for real in REAL_FILES:
        path = into / real.name
        if not _good(path, real.sha256):
            raise RuntimeError(f"{path} does not have the SHA-256 {real.sha256}")
        paths[real.name] = path
    return paths


def _good(path: Path, sha256: str) -> bool:
    return path.exists() and _sha256(path) == sha256


def _download(package: str, version: str, files: list[RealFile], into: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["apt-get", "download", "-q", f"{package}={version}"], cwd=tmp, check=True, capture_output=True)
        deb = next(Path(tmp).glob(f"{package}_*.deb"))
        subprocess.run(["dpkg-deb", "-x", str(deb), str(Path(tmp) / "x")], check=True)
        for real in files:
            shutil.copyfile(Path(tmp) / "x" / real.member, into / real.name)


if __name__ == "__main__":
    for name, path in fetch().items():
        print(f"{name}: {path.stat().st_size:,} bytes, SHA-256 checked")
