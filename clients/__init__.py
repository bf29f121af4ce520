"""Python clients for the longdoc server, and the `longdoc` command line."""

from clients.client import ApiError, AsyncLongdocClient, Event, LongdocClient

__all__ = ["ApiError", "AsyncLongdocClient", "Event", "LongdocClient"]
