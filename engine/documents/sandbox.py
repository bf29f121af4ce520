"""A parse in a child process under a wall-clock and an address-space limit, so one hostile file
can neither hang nor exhaust the server. The child is a fresh interpreter that loads the parsers
and nothing else (no model, no torch threads); the file goes in on stdin and the text, pages and
sections come back as JSON (never pickle: the child handles hostile bytes)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from dataclasses import asdict
from typing import Any

from engine.config import ParseLimits
from engine.documents.parsers import parse_in_process
from engine.errors import DocumentError, LongdocError, UnsupportedFormatError
from engine.interface import Layout, ParsedDocument

CHILD_ENVIRONMENT = ("PATH", "PYTHONPATH", "LANG", "LC_ALL", "TMPDIR")
ERRORS: dict[str | None, type[LongdocError]] = {
    "invalid_document": DocumentError,
    "unsupported_media_type": UnsupportedFormatError,
}


def parse_sandboxed(data: bytes, format: str, charset: str | None, limits: ParseLimits) -> ParsedDocument:
    """Blocking: run on a thread. Raises the parser's error, or DocumentError for a timeout or a crash."""
    arguments = [format, charset or "", json.dumps(asdict(limits))]
    environment = {name: os.environ[name] for name in CHILD_ENVIRONMENT if name in os.environ}  # no keys or secrets
    try:
        child = subprocess.run(
            [sys.executable, "-m", "engine.documents.sandbox", *arguments],
            input=data,
            capture_output=True,
            timeout=limits.seconds,
            check=False,
            env=environment,
        )
    except subprocess.TimeoutExpired:
        raise DocumentError(f"parsing took longer than {limits.seconds:g} s (LONGDOC_PARSE_SECONDS)") from None
    try:
        reply = json.loads(child.stdout)
    except ValueError:
        raise DocumentError(
            f"the parser stopped on this file (exit status {child.returncode}: over {limits.memory_bytes} bytes of memory, or a crash)"
        ) from None
    if "error" in reply:
        raise ERRORS.get(reply.get("kind"), DocumentError)(str(reply["error"]))
    return _checked(reply)


def _checked(reply: dict[str, Any]) -> ParsedDocument:
    """The child's reply as a document, its shape checked (the child handled hostile bytes)."""
    try:
        text, layout = reply["text"], Layout.from_dict(reply["layout"])
        pages, starts = layout.pages, [s.start for s in layout.sections]
        valid = (
            isinstance(text, str)
            and all(isinstance(p, int) and 0 <= p <= len(text) for p in pages)
            and list(pages) == sorted(pages)
            and all(isinstance(s, int) and 0 <= s <= len(text) for s in starts)
            and all(isinstance(s.title, str) and isinstance(s.level, int) for s in layout.sections)
        )
    except (KeyError, TypeError, AttributeError):
        valid = False
    if not valid:
        raise DocumentError("the parser's reply for this file was malformed")
    return ParsedDocument(text, layout)


def _limit_memory(extra: int) -> None:
    with open("/proc/self/statm") as statm:
        now = int(statm.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (now + extra, now + extra))


def _main() -> None:
    format, charset, limits_json = sys.argv[1:4]
    limits = ParseLimits(**json.loads(limits_json))
    _limit_memory(limits.memory_bytes)
    data = sys.stdin.buffer.read()
    try:
        reply = asdict(parse_in_process(data, format, charset or None, limits))
    except LongdocError as exc:
        reply = {"error": exc.message, "kind": exc.kind}
    except MemoryError:
        reply = {
            "error": f"parsing this file needed more than {limits.memory_bytes} bytes (LONGDOC_PARSE_MEMORY_BYTES)",
            "kind": "",
        }
    except RecursionError:
        reply = {"error": "the file is nested too deeply to parse", "kind": ""}
    except Exception as exc:  # noqa: BLE001 - a parser library failing on a broken file is the file's fault
        reply = {"error": f"the {format} file cannot be parsed ({type(exc).__name__}: {exc})", "kind": ""}
    sys.stdout.write(json.dumps(reply))


if __name__ == "__main__":
    _main()
