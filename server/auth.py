"""API keys: who is calling, and which sessions they may see.

Keys come from `api_key` (one key), `api_keys_file` (one `name:key` or bare `key` a line; `#`
starts a comment) and `admin_key`. With no key configured, /v1 is open and every session is
visible to everyone. With keys, a session belongs to the key that made it: other keys get 404
for it, as if it did not exist; the admin key sees and may act on every session. Keys are compared
in constant time, every configured key on every request, and are never logged: a caller is named
by the key's name, or by a short hash of it.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from pathlib import Path

ADMIN = "admin"


@dataclass(frozen=True)
class Caller:
    name: str  # the owner recorded on sessions this caller makes
    admin: bool = False

    def may_see(self, owner: str | None) -> bool:
        return self.admin or owner == self.name


@dataclass(frozen=True)
class _Key:
    secret: bytes
    caller: Caller


def key_name(key: str) -> str:
    """A name for an unnamed key that reveals nothing usable about it."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def read_keys_file(path: Path) -> list[tuple[str, str]]:
    """(name, key) pairs from a keys file; a bare key is named by its hash."""
    pairs = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, key = line.partition(":")
        name, key = (name.strip(), key.strip()) if sep else ("", name.strip())
        if not key:
            raise ValueError(f"{path}:{number}: an empty key")
        pairs.append((name or key_name(key), key))
    return pairs


class KeyRing:
    """The configured keys; `identify` maps a bearer token to its caller."""

    def __init__(self, keys: list[tuple[str, str]], admin_key: str | None = None) -> None:
        self._keys = [_Key(key.encode(), Caller(name)) for name, key in keys]
        if admin_key:
            self._keys.append(_Key(admin_key.encode(), Caller(ADMIN, admin=True)))
        names = [k.caller.name for k in self._keys]
        if len(set(names)) != len(names):
            raise ValueError("two API keys share a name")
        if len({k.secret for k in self._keys}) != len(self._keys):
            raise ValueError("the same API key is configured twice")

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def identify(self, token: str) -> Caller | None:
        """The caller whose key is `token`, or None; compares against every key."""
        found = None
        for key in self._keys:
            if secrets.compare_digest(token.encode(), key.secret):
                found = key.caller
        return found
