"""Which replica owns a session: pure functions, shared by the ingress and the request router.

A replica names itself in the ids of the sessions it makes (`s-<replica>-<random>`), so a new
session's requests reach the replica that made it. When that replica is gone (or the id names
none, as for sessions made by `longdoc serve`), the owner is the live replica that ranks first
for the session by rendezvous hashing: every router computes the same owner from the same
replica set, and a replica's leaving moves only its own sessions."""

from __future__ import annotations

import hashlib
import json
import re

SESSION_PATH = re.compile(r"^/v1/sessions/([^/]+)")
CHAT_PATH = "/v1/chat/completions"


def session_prefix(replica: str) -> str:
    """What the ids of sessions made by `replica` start with."""
    return f"s-{replica}-"


def named_replica(session_id: str) -> str | None:
    """The replica a session id names (None for an id of another form)."""
    parts = session_id.split("-")
    return parts[1] if len(parts) == 3 and parts[0] == "s" else None


def owner_of(session_id: str, replicas: list[str]) -> str:
    """The replica that serves `session_id` among the live `replicas` (not empty)."""
    named = named_replica(session_id)
    if named in replicas:
        return named
    return max(replicas, key=lambda replica: hashlib.sha256(f"{session_id}/{replica}".encode()).digest())


def makes_session(method: str, path: str) -> bool:
    """Whether a request makes a new session (`POST /v1/sessions`)."""
    return method == "POST" and path.rstrip("/") == "/v1/sessions"


def in_turn(turn: int, replicas: list[str]) -> str:
    """The live replica (of `replicas`, not empty) the `turn`-th new session goes to: round robin
    over the sorted names, so sessions made together spread evenly whatever each one's timing."""
    return sorted(replicas)[turn % len(replicas)]


def session_in(method: str, path: str, body: bytes) -> str | None:
    """The session a request names: in its path, or a chat completion's `session_id` field."""
    match = SESSION_PATH.match(path)
    if match:
        return match.group(1)
    if method == "POST" and path == CHAT_PATH:
        try:
            value = json.loads(body).get("session_id")
        except (ValueError, AttributeError):
            return None  # the replica answers the bad body with its 4xx
        return value if isinstance(value, str) else None
    return None
