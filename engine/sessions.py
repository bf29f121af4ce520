"""Sessions: each holds one memory of its documents, under explicit limits."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from engine.config import SessionLimits
from engine.errors import BudgetExceededError, NotFoundError, SessionLimitError
from engine.interface import DocumentInfo, SessionInfo
from engine.memories import Memory


@dataclass
class Session:
    id: str
    model: str
    memory: Memory
    options: dict[str, Any]
    created_at: float
    last_used_at: float
    documents: list[DocumentInfo] = field(default_factory=list)
    ingest_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    busy: int = 0  # requests in flight; a busy session is never evicted

    def info(self) -> SessionInfo:
        return SessionInfo(
            id=self.id,
            model=self.model,
            memory=self.memory.kind,
            options=dict(self.options),
            created_at=self.created_at,
            last_used_at=self.last_used_at,
            documents=tuple(self.documents),
            cache=self.memory.stats(),
        )


class SessionStore:
    def __init__(self, limits: SessionLimits, clock: Any = time.time) -> None:
        self.limits = limits
        self._clock = clock
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, model: str, memory: Memory, options: dict[str, Any]) -> Session:
        self.evict_idle()
        if len(self._sessions) >= self.limits.max_sessions:
            raise SessionLimitError(f"the server holds its limit of {self.limits.max_sessions} sessions", 30.0)
        now = self._clock()
        session = Session(
            id="s-" + secrets.token_hex(8), model=model, memory=memory, options=options, created_at=now, last_used_at=now
        )
        self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFoundError(f"no session {session_id!r}")
        session.last_used_at = self._clock()
        return session

    def delete(self, session_id: str) -> None:
        if self._sessions.pop(session_id, None) is None:
            raise NotFoundError(f"no session {session_id!r}")

    def list(self) -> list[Session]:
        return list(self._sessions.values())

    def evict_idle(self) -> list[str]:
        """Drop sessions idle longer than the TTL that have nothing in flight."""
        deadline = self._clock() - self.limits.idle_ttl_seconds
        idle = [s.id for s in self._sessions.values() if s.last_used_at < deadline and s.busy == 0]
        for session_id in idle:
            del self._sessions[session_id]
        return idle

    def budget_left(self, session: Session) -> int:
        return self.limits.memory_budget_bytes - session.memory.stats().bytes

    def check_budget(self, session: Session, extra_bytes: int) -> None:
        left = self.budget_left(session)
        if extra_bytes > left:
            raise BudgetExceededError(
                f"session {session.id} would need {extra_bytes} more bytes of memory; {left} of its "
                f"{self.limits.memory_budget_bytes}-byte budget are left (clear its cache or use a new session)",
                60.0,
            )
