"""Errors a user can cause. The server maps each class to one HTTP status; nothing here knows HTTP."""

from __future__ import annotations


class LongdocError(Exception):
    """Base class: `kind` names the error in API responses."""

    kind = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequestError(LongdocError):
    kind = "invalid_request"


class NotFoundError(LongdocError):
    kind = "not_found"


class ConflictError(LongdocError):
    """The session is doing something this request cannot run beside (clearing while ingesting)."""

    kind = "conflict"


class TooLargeError(LongdocError):
    kind = "too_large"


class NotReadyError(LongdocError):
    kind = "not_ready"


class RetryLaterError(LongdocError):
    """The request is fine but cannot be served now; `retry_after` is a hint in seconds."""

    kind = "overloaded"

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class QueueFullError(RetryLaterError):
    kind = "queue_full"


class BudgetExceededError(RetryLaterError):
    kind = "memory_budget_exceeded"


class SessionLimitError(RetryLaterError):
    kind = "too_many_sessions"


class SnapshotUnreadableError(LongdocError):
    """A session saved on disk cannot be read back (a fault of the server's storage, not the request)."""

    kind = "snapshot_unreadable"


class StorageError(LongdocError):
    """The server could not save a session (its disk is full or failing); the session stays in RAM."""

    kind = "insufficient_storage"


class DocumentError(InvalidRequestError):
    """A file that cannot be read as the format it is: corrupt, encrypted, without text, too deep or too big unpacked."""

    kind = "invalid_document"


class UnsupportedFormatError(InvalidRequestError):
    """A body longdoc does not read: a media type or charset it does not know, bytes not in the charset."""

    kind = "unsupported_media_type"
