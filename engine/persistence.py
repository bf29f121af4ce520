"""Session snapshots on disk: what a session holds survives restarts, crashes and eviction.

A session lives in `<data dir>/<session id>/`:

    session.json           the commit point: format version, the session's metadata, the memory's
                           non-tensor state, and the name and SHA-256 of its tensors file
    state-<n>.safetensors  the memory's tensors (numpy arrays and torch tensors, by path)
    used                   touched when a server that shares the folder uses the session (its
                           modification time only)

A snapshot is written as a new tensors file, then session.json, each to a temporary name,
fsynced and renamed, then the folder is fsynced; older tensors files go last. A crash at any
point leaves the previous snapshot or the new one, never a mix. Reading checks the version and
the checksum; a bad snapshot raises `SnapshotError` and is left on disk for an operator.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

FORMAT = "longdoc-session-v1"
MANIFEST = "session.json"
USED = "used"  # touched when a session is used, by servers that share the data folder
SESSION_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")
INLINE_TEXT_CHARS = 256  # longer strings (documents) go to the tensors file, not the manifest


class SnapshotError(Exception):
    """A snapshot that cannot be read back: missing, corrupt, or of another format version."""


@dataclass(frozen=True)
class Snapshot:
    session: dict[str, Any]  # id, model, memory, options, owner, times, documents
    state: dict[str, Any]  # the memory's state_dict


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

    def write(self, snapshot: Snapshot) -> None:
        """Write a snapshot atomically."""
        folder = self.folder(snapshot.session["id"])
        if not folder.is_dir():
            folder.mkdir(parents=True)
            _fsync(self.root)  # the new folder's entry is durable too
        tensors: dict[str, torch.Tensor] = {}
        state = pack(snapshot.state, tensors)
        generation = self._generation(folder) + 1
        tensors_name = f"state-{generation}.safetensors"
        tmp = folder / f".{tensors_name}.tmp"
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
        tmp = folder / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(manifest))
        _publish(tmp, folder / MANIFEST)
        _fsync(folder)
        for old in folder.glob("state-*.safetensors"):
            if old.name != tensors_name:
                old.unlink(missing_ok=True)

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

    def read_session(self, session_id: str) -> dict[str, Any]:
        """The session's metadata alone (no tensors read): for listing sessions at start."""
        return self._manifest(self.folder(session_id))["session"]

    def read(self, session_id: str) -> Snapshot:
        folder = self.folder(session_id)
        manifest = self._manifest(folder)
        path = folder / manifest["tensors"]
        if not path.is_file() or _sha256(path) != manifest["sha256"]:
            raise SnapshotError(f"{path} is missing or does not match its checksum")
        try:
            tensors = load_file(path)
            return Snapshot(manifest["session"], unpack(manifest["state"], tensors))
        except (OSError, KeyError, ValueError) as exc:
            raise SnapshotError(f"{folder}: {exc}") from exc

    def delete(self, session_id: str) -> None:
        shutil.rmtree(self.folder(session_id), ignore_errors=True)

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
