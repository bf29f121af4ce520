"""Session snapshots on disk: what a session holds survives restarts, crashes and eviction.

A session lives in `<data dir>/<session id>/`:

    session.json           the commit point: format version, the session's metadata, the memory's
                           non-tensor state, and the name and SHA-256 of its tensors file
    state-<n>.safetensors  the memory's tensors (numpy arrays and torch tensors, by path)
    used                   touched when a server that shares the folder uses the session (its
                           modification time only)
    lock                   held (flock) while a snapshot is written or the folder deleted

A snapshot is written as a new tensors file, then session.json, each to a temporary name of its
own, fsynced and renamed, then the folder is fsynced; older tensors files go last. A crash at any
point leaves the previous snapshot or the new one, never a mix. Reading checks the version and
the checksum; a bad snapshot raises `SnapshotError` and is left on disk for an operator.

Each snapshot has a generation, one more than the one it replaces. A writer names the generation
its state was read from or last written as; under the folder's lock, a snapshot written since (by
another server sharing the folder) refuses the write with `StaleSnapshotError`, so no server
overwrites a document another committed. On NFS, Linux takes flock as a lock held by the server.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)

FORMAT = "longdoc-session-v1"
MANIFEST = "session.json"
USED = "used"  # touched when a session is used, by servers that share the data folder
LOCK = "lock"
SESSION_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")
INLINE_TEXT_CHARS = 256  # longer strings (documents) go to the tensors file, not the manifest


class SnapshotError(Exception):
    """A snapshot that cannot be read back: missing, corrupt, or of another format version."""


class StaleSnapshotError(Exception):
    """A write refused: the session was written or deleted by another server since the writer read it."""


@dataclass(frozen=True)
class Snapshot:
    session: dict[str, Any]  # id, model, memory, options, owner, times, documents
    state: dict[str, Any]  # the memory's state_dict
    generation: int = 0  # as read; a write sets the next one


def pack(value: Any, tensors: dict[str, torch.Tensor], path: str = "s") -> Any:
    """A JSON-able description of a state_dict; its arrays go to `tensors` under their paths."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().cpu().contiguous()
        return {"tensor": path}
    if isinstance(value, np.ndarray):
        tensors[path] = torch.from_numpy(np.ascontiguousarray(value))
        return {"array": path}
    if isinstance(value, dict):
        return {"dict": {str(k): pack(v, tensors, f"{path}.{k}") for k, v in value.items()}}
    if isinstance(value, (list, tuple)):
        return {"list": [pack(v, tensors, f"{path}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, str) and len(value) > INLINE_TEXT_CHARS:  # a document: bytes, covered by the checksum
        tensors[path] = torch.frombuffer(bytearray(value.encode("utf-8")), dtype=torch.uint8)
        return {"text": path}
    if value is None or isinstance(value, (str, int, float, bool)):
        return {"value": value}
    raise TypeError(f"cannot save a {type(value).__name__} at {path}")


def unpack(packed: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if "tensor" in packed:
        return tensors[packed["tensor"]]
    if "array" in packed:
        return tensors[packed["array"]].numpy()
    if "text" in packed:
        return bytes(tensors[packed["text"]].numpy()).decode("utf-8")
    if "dict" in packed:
        return {k: unpack(v, tensors) for k, v in packed["dict"].items()}
    if "list" in packed:
        return [unpack(v, tensors) for v in packed["list"]]
    return packed["value"]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, final: Path) -> None:
    _fsync(tmp)
    os.replace(tmp, final)


def _tmp_name(folder: Path, name: str) -> Path:
    """A temporary name no other writer uses (servers sharing a folder write beside each other)."""
    return folder / f".{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"


@contextlib.contextmanager
def _locked(folder: Path, shared: bool = False) -> Iterator[None]:
    """Hold the folder's lock (shared: for reading): FileNotFoundError when the folder is gone."""
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


class SnapshotStore:
    """Snapshots under one data folder, one subfolder a session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def folder(self, session_id: str) -> Path:
        if not session_id or not set(session_id) <= SESSION_ID_CHARS:
            raise ValueError(f"not a session id: {session_id!r}")
        return self.root / session_id

    def list(self) -> list[str]:
        """Ids of the sessions with a manifest on disk."""
        return sorted(p.parent.name for p in self.root.glob(f"*/{MANIFEST}") if set(p.parent.name) <= SESSION_ID_CHARS)

    def write(self, snapshot: Snapshot, expected: int | None = None) -> int:
        """Write a snapshot atomically; returns its generation. With `expected` (the generation
        the state was read from or last written as, 0 for a new session), a snapshot written or
        deleted since raises `StaleSnapshotError` and nothing is written."""
        folder = self.folder(snapshot.session["id"])
        if not folder.is_dir() and not expected:
            folder.mkdir(parents=True, exist_ok=True)
            _fsync(self.root)  # the new folder's entry is durable too
        try:
            with _locked(folder):
                current = self._generation(folder)
                if expected is not None and current != expected:
                    raise StaleSnapshotError(f"{folder} is at generation {current}, not {expected}")
                return self._write_next(folder, snapshot, current + 1)
        except FileNotFoundError as exc:
            if expected:
                raise StaleSnapshotError(f"{folder} was deleted") from exc
            raise

    def _write_next(self, folder: Path, snapshot: Snapshot, generation: int) -> int:
        tensors: dict[str, torch.Tensor] = {}
        state = pack(snapshot.state, tensors)
        tensors_name = f"state-{generation}.safetensors"
        tmp = _tmp_name(folder, tensors_name)
        save_file(tensors, tmp)
        _publish(tmp, folder / tensors_name)
        manifest = {
            "format": FORMAT,
            "generation": generation,
            "session": snapshot.session,
            "state": state,
            "tensors": tensors_name,
            "sha256": _sha256(folder / tensors_name),
        }
        tmp = _tmp_name(folder, MANIFEST)
        tmp.write_text(json.dumps(manifest))
        _publish(tmp, folder / MANIFEST)
        try:  # the snapshot is in place: what follows cannot take it back
            _fsync(folder)
            for old in folder.glob("state-*.safetensors"):
                if old.name != tensors_name:
                    old.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("%s: generation %d written, cleaning up after it failed: %s", folder, generation, exc)
        return generation

    def stamp(self, session_id: str) -> tuple[int, int, int] | None:
        """What changes whenever the session's snapshot is written (each write renames a new
        manifest into place): None when there is none."""
        try:
            stat = (self.folder(session_id) / MANIFEST).stat()
        except (OSError, ValueError):
            return None
        return (stat.st_ino, stat.st_mtime_ns, stat.st_size)

    def mark_used(self, session_id: str) -> None:
        """Record a use that wrote nothing (for servers sharing the folder: `last_activity`)."""
        with contextlib.suppress(OSError, ValueError):
            (self.folder(session_id) / USED).touch()

    def last_activity(self, session_id: str) -> float:
        """When the session was last written or marked used (epoch seconds; 0 when unknown)."""
        times = [0.0]
        for name in (MANIFEST, USED):
            with contextlib.suppress(OSError, ValueError):
                times.append((self.folder(session_id) / name).stat().st_mtime)
        return max(times)

    def read_session(self, session_id: str) -> tuple[dict[str, Any], int]:
        """The session's metadata alone (no tensors read), and its generation: for listing sessions."""
        manifest = self._manifest(self.folder(session_id))
        return manifest["session"], int(manifest.get("generation", 0))

    def read(self, session_id: str) -> Snapshot:
        folder = self.folder(session_id)
        try:
            with _locked(folder, shared=True):  # no writer removes the tensors file under the reader
                return self._read(folder)
        except FileNotFoundError as exc:
            raise SnapshotError(f"{folder} is gone") from exc

    def _read(self, folder: Path) -> Snapshot:
        manifest = self._manifest(folder)
        path = folder / manifest["tensors"]
        if not path.is_file() or _sha256(path) != manifest["sha256"]:
            raise SnapshotError(f"{path} is missing or does not match its checksum")
        try:
            tensors = load_file(path)
            return Snapshot(manifest["session"], unpack(manifest["state"], tensors), int(manifest.get("generation", 0)))
        except (OSError, KeyError, ValueError) as exc:
            raise SnapshotError(f"{folder}: {exc}") from exc

    def delete(self, session_id: str, expected: int | None = None) -> bool:
        """Delete the session's files, not in the middle of a write; with `expected`, only when
        its snapshot is still that generation (a drop for age must not take a newer write with
        it). The folder is renamed away under the lock, then removed. Returns whether it was."""
        folder = self.folder(session_id)
        gone = self.root / f".deleted-{session_id}-{secrets.token_hex(4)}"
        try:
            with _locked(folder):
                if expected is not None and self._generation(folder) != expected:
                    return False
                folder.rename(gone)
        except FileNotFoundError:
            return False
        shutil.rmtree(gone, ignore_errors=True)
        return True

    def _manifest(self, folder: Path) -> dict[str, Any]:
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            raise SnapshotError(f"{folder / MANIFEST} cannot be read: {exc}") from exc
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise SnapshotError(f"{folder / MANIFEST} is not a {FORMAT} snapshot")
        return manifest

    def _generation(self, folder: Path) -> int:
        try:
            return int(json.loads((folder / MANIFEST).read_text()).get("generation", 0))
        except (OSError, ValueError, AttributeError):
            return max((int(p.stem.split("-")[1]) for p in folder.glob("state-*.safetensors")), default=0)
