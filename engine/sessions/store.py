"""Sessions: each holds one memory of its documents, under explicit limits."""

from __future__ import annotations

import asyncio
import builtins
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.config import SessionLimits
from engine.errors import BudgetExceededError, NotFoundError, SessionLimitError, TooLargeError
from engine.interface import CacheInfo, DocumentInfo, SessionInfo
from engine.memories import Memory


@dataclass
class Session:
    """A session's metadata and, while it is resident, its memory. A session evicted to disk
    (`memory` None) keeps what it needs to describe itself; the engine loads it back on use."""

    id: str
    model: str
    kind: str  # the memory's kind
    memory: Memory | None
    options: dict[str, Any]
    created_at: float
    last_used_at: float
    documents: list[DocumentInfo] = field(default_factory=list)
    # held by whatever writes the memory (ingestion, clearing, an answer that writes) and by answers
    # that read what ingestion appends
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    load_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one load from disk at a time
    requests_in_flight: int = 0  # a session with requests in flight is never evicted
    deleted: bool = False  # set when the store drops it; work in flight stops at its next step
    reserved: int = 0  # bytes reserved for this session's work in flight
    owner: str | None = None
    saved_cache: CacheInfo | None = None  # the memory's stats as last saved, shown while on disk
    dirty: bool = False  # RAM holds changes its snapshot lacks (a save failed): never evicted
    save_lock: threading.Lock = field(default_factory=threading.Lock)  # one save or delete of its files at a time
    snapshot_stamp: tuple[int, int, int] | None = None  # its snapshot on disk as last written or read here
    snapshot_generation: int = 0  # that snapshot's generation (0: none yet); a save expects it on disk
    marked_used_at: float = 0.0  # when this server last recorded a use on disk (shared data folder)

    @property
    def resident(self) -> bool:
        return self.memory is not None

    @property
    def memory_bytes(self) -> int:
        return self.memory.stats().bytes if self.memory is not None else 0

    def cache(self) -> CacheInfo:
        if self.memory is not None:
            return self.memory.stats()
        assert self.saved_cache is not None, "a session on disk keeps its last stats"
        return self.saved_cache

    def info(self) -> SessionInfo:
        return SessionInfo(
            id=self.id,
            model=self.model,
            memory=self.kind,
            options=dict(self.options),
            created_at=self.created_at,
            last_used_at=self.last_used_at,
            documents=tuple(self.documents),
            cache=self.cache(),
            owner=self.owner,
            resident=self.resident,
        )

    def metadata(self) -> dict[str, Any]:
        """What a snapshot keeps besides the memory's state (plain JSON)."""
        return {
            "id": self.id,
            "model": self.model,
            "memory": self.kind,
            "options": self.options,
            "owner": self.owner,
            "created_at": self.created_at,
            "last_used_at": self.last_used_at,
            "documents": [asdict(d) for d in self.documents],
            "cache": asdict(self.cache()),
        }

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> Session:
        """A session on disk, as a snapshot describes it."""
        return cls(
            id=meta["id"],
            model=meta["model"],
            kind=meta["memory"],
            memory=None,
            options=dict(meta["options"]),
            created_at=float(meta["created_at"]),
            last_used_at=float(meta["last_used_at"]),
            documents=[DocumentInfo.from_dict(d) for d in meta["documents"]],
            owner=meta.get("owner"),
            saved_cache=CacheInfo(**meta["cache"]),
        )


class Pin:
    """Keeps a session resident (never evicted) while a request uses it; released once."""

    def __init__(self, session: Session) -> None:
        self._session: Session | None = session
        session.requests_in_flight += 1

    def release(self) -> None:
        if self._session is not None:
            self._session.requests_in_flight -= 1
            self._session = None


class Reservation:
    """Bytes promised to work in flight (a memory being made, a document being staged) before
    they are allocated. Released when the work ends; what was committed is then counted by the
    memories themselves."""

    def __init__(self, store: SessionStore, session: Session | None, nbytes: int, transient: bool = False) -> None:
        self._store, self.session, self.nbytes, self.transient = store, session, nbytes, transient

    def grow_to(self, nbytes: int) -> None:
        """Ask for more, under the same budgets; raises like `SessionStore.reserve`."""
        with self._store.books_lock:
            if nbytes > self.nbytes:
                self._store._check(self.session, nbytes - self.nbytes, self.transient)
                self._add(nbytes - self.nbytes)

    def shrink_to(self, nbytes: int) -> None:
        """Give back what is over `nbytes` (nothing when it holds no more)."""
        self._add(min(0, nbytes - self.nbytes))

    def release(self) -> None:
        """Give the bytes back; releasing twice is harmless."""
        self._add(-self.nbytes)

    def _add(self, nbytes: int) -> None:
        with self._store.books_lock:
            self.nbytes += nbytes
            self._store._reserved += nbytes
            if self.session is not None:
                self.session.reserved += nbytes

    def __del__(self) -> None:  # a request dropped before it ran must not keep its bytes
        self.release()

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class SessionStore:
    """Sessions under explicit limits: a count, an idle TTL, and memory budgets per session and
    for all sessions together. Every allocation a client can cause is reserved here first.

    With `keep_on_disk` (sessions are saved as they change), an idle session, or the least
    recently used one when the server's budget is short, leaves RAM for disk instead of being
    dropped; otherwise idle sessions are dropped."""

    def __init__(
        self, limits: SessionLimits, clock: Any = time.time, *, keep_on_disk: bool = False, id_prefix: str = "s-"
    ) -> None:
        self.limits = limits
        self.id_prefix = id_prefix
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._reserved = 0  # bytes of every live Reservation
        self.keep_on_disk = keep_on_disk
        # guards the sessions and the byte books (reservations, use): the event loop and the workers'
        # threads (a growing ingestion) both reach them
        self.books_lock = threading.RLock()
        self.on_drop: Callable[[Session], None] | None = None  # told of sessions dropped for good (their files)
        # asked before a session on disk is dropped for being unused: True when it is used elsewhere
        self.used_elsewhere: Callable[[Session], bool] = lambda session: False
        # optional caches (engine/runtime/prefix_cache.py): each `reclaim(nbytes)` gives back up to
        # about that many of its bytes, and says how many, when a reservation finds the server short
        self.reclaimers: list[Callable[[int], int]] = []
        # told the id of each session that leaves RAM (deleted, dropped, or moved to disk), after
        # it is marked so: what optional caches keep for it goes
        self.on_leave: list[Callable[[str], None]] = []

    def __len__(self) -> int:
        return len(self._sessions)

    def check_room(self) -> None:
        """Refuse a new session when the store holds its limit (after dropping idle ones)."""
        self.evict_idle()
        if len(self._sessions) >= self.limits.max_sessions:
            raise SessionLimitError(f"the server holds its limit of {self.limits.max_sessions} sessions", 30.0)

    def create(
        self, model: str, memory: Memory, options: dict[str, Any], owner: str | None = None, session_id: str | None = None
    ) -> Session:
        self.check_room()
        now = self._clock()
        session = Session(
            id=session_id or self.id_prefix + secrets.token_hex(8),
            model=model,
            kind=memory.kind,
            memory=memory,
            options=options,
            created_at=now,
            last_used_at=now,
            owner=owner,
        )
        with self.books_lock:
            self._sessions[session.id] = session
        return session

    def add(self, session: Session) -> None:
        """Hold a session found on disk (not resident)."""
        with self.books_lock:
            self._sessions[session.id] = session

    def peek(self, session_id: str) -> Session | None:
        """The session if held (in RAM or listed from disk), not marked used."""
        return self._sessions.get(session_id)

    def use(self, session_id: str) -> Session:
        """The session, marked used now (an idle session is evicted `idle_ttl_seconds` after its last use)."""
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFoundError(f"no session {session_id!r}")
        session.last_used_at = self._clock()
        return session

    def delete(self, session_id: str) -> Session:
        with self.books_lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            raise NotFoundError(f"no session {session_id!r}")
        session.deleted = True
        self._left(session)
        return session

    def list(self) -> list[Session]:
        with self.books_lock:
            return list(self._sessions.values())

    def _evictable(self, session: Session) -> bool:
        return session.resident and session.requests_in_flight == 0 and session.reserved == 0 and not session.dirty

    def evict_idle(self) -> builtins.list[Session]:  # `list` in this class is the method above
        """Sessions idle longer than the TTL leave RAM: for disk with `keep_on_disk`, else they are
        dropped; sessions on disk unused for `saved_ttl_seconds` are dropped. Returns the dropped
        ones (marked deleted; `on_drop` is told, to remove their files)."""
        now, dropped = self._clock(), []
        with self.books_lock:
            for session in list(self._sessions.values()):
                if self._evictable(session) and session.last_used_at < now - self.limits.idle_ttl_seconds:
                    self._evict(session)
                elif (
                    not session.resident
                    and session.requests_in_flight == 0
                    and session.last_used_at < now - self.limits.saved_ttl_seconds
                    and not self.used_elsewhere(session)
                ):
                    self._drop(session)
                if session.deleted:
                    dropped.append(session)
        if self.on_drop is not None:
            for session in dropped:
                self.on_drop(session)
        return dropped

    def _drop(self, session: Session) -> None:
        self._sessions.pop(session.id)
        session.deleted = True
        self._left(session)

    def _evict(self, session: Session) -> None:
        if self.keep_on_disk:
            session.saved_cache, session.memory = session.cache(), None
            self._left(session)
        else:
            self._drop(session)

    def _left(self, session: Session) -> None:
        for forget in self.on_leave:
            forget(session.id)

    def evict_for(self, nbytes: int, keep: Session | None = None, used: int | None = None) -> int:
        """Move least recently used idle sessions to disk until `nbytes` more fit the server budget;
        returns the bytes held after (`used`: held before, if the caller has just summed them)."""
        used = self.used_bytes() if used is None else used
        if not self.keep_on_disk:
            return used
        candidates = sorted(
            (s for s in self._sessions.values() if self._evictable(s) and s is not keep), key=lambda s: s.last_used_at
        )
        for session in candidates:
            if used + nbytes <= self.limits.server_memory_bytes:
                return used
            used -= session.memory_bytes
            self._evict(session)
        return used

    # ---- memory budgets ----------------------------------------------------------------------

    def used_bytes(self) -> int:
        """Committed bytes of every session's memory, plus every reservation."""
        with self.books_lock:
            return sum(s.memory_bytes for s in self._sessions.values()) + self._reserved

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    def reserve(self, session: Session | None, nbytes: int, *, transient: bool = False, optional: bool = False) -> Reservation:
        """Promise `nbytes` to work for `session` (None: a session being made). A `transient`
        reservation (a generation's key/value cache) is the server's, not a session memory's: only
        the server's budget applies to it. An `optional` one (a cache's) takes only what is free:
        it moves no session out of RAM and takes nothing from the `reclaimers`; any other takes
        back what they hold before it moves sessions or is refused.

        Raises:
            TooLargeError (413): `nbytes` alone is over the per-session or the server budget, so
                no retry can succeed.
            BudgetExceededError (429, Retry-After): it would fit, but the session's or the
                server's memory holds too much now (clear a cache, delete sessions, or wait for
                idle ones to expire).
        """
        with self.books_lock:
            self._check(session, nbytes, transient, optional)
            reservation = Reservation(self, session, 0, transient)
            reservation._add(nbytes)
        return reservation

    def check_fits(self, nbytes: int) -> None:
        """TooLargeError (413) when `nbytes` of transient work could never fit the server's budget."""
        if nbytes > self.limits.server_memory_bytes:
            raise TooLargeError(
                f"this needs {nbytes} bytes; all sessions together may hold {self.limits.server_memory_bytes} "
                "(LONGDOC_MAX_MEMORY_BYTES)"
            )

    def _check(self, session: Session | None, nbytes: int, transient: bool = False, optional: bool = False) -> None:
        per_session, server = self.limits.memory_budget_bytes, self.limits.server_memory_bytes
        if nbytes > per_session and not transient:
            raise TooLargeError(
                f"this needs {nbytes} bytes of session memory; a session may hold {per_session} (LONGDOC_SESSION_MEMORY_BYTES)"
            )
        self.check_fits(nbytes)
        if session is not None and not transient:
            held = session.memory_bytes + session.reserved
            if held + nbytes > per_session:
                raise BudgetExceededError(
                    f"session {session.id} would need {nbytes} more bytes of memory; {per_session - held} of its "
                    f"{per_session}-byte budget are left (clear its cache or use a new session)",
                    60.0,
                )
        used = self.used_bytes()
        if used + nbytes > server and not optional:
            for reclaim in self.reclaimers:
                if used + nbytes > server:
                    used -= reclaim(used + nbytes - server)
            used = self.evict_for(nbytes, keep=session, used=used)
        if used + nbytes > server:
            raise BudgetExceededError(
                f"the server's session memory is full: {used} of {server} bytes held, {nbytes} more needed "
                "(retry after other sessions are deleted or expire)",
                30.0,
            )
