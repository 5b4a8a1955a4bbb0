"""Typed store errors, shared by client and server.

Every error the server can report has a short wire code, so a reply carries the
code (plus a message and the key) and the client re-raises the same typed
exception. Callers can then tell a cache miss (MissingBlockError: recompute)
from a broken block (CorruptBlockError) without parsing messages.
"""
from __future__ import annotations

import reprlib

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxset = 2, 4, 4, 4, 4
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 40


def short_repr(value: object, limit: int = 60) -> str:
    """A repr of a (possibly malformed, huge or deeply nested) value for a one-line error
    message: bounded in length and in the time it takes, whatever the value."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<integer of {value.bit_length()} bits>"  # repr() of a huge int is slow or refused
    try:
        r = _REPR.repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the real error
        r = f"<{type(value).__name__}>"
    r = r.replace("\n", "\\n").replace("\r", "\\r")
    return r if len(r) <= limit else r[: limit - 3] + "..."


class StoreError(Exception):
    """Base of every store error. `key` names the block when one is involved."""

    code = "error"

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class MissingBlockError(StoreError, KeyError):
    code = "missing"

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return self.args[0] if self.args else "missing block"


class BadKeyError(StoreError, ValueError):
    """The key does not match the key format (and so never touches a path)."""

    code = "bad_key"


class StoreFullError(StoreError):
    """Capacity exceeded or the disk itself is full (ENOSPC/EDQUOT)."""

    code = "full"


class CorruptBlockError(StoreError):
    """The stored bytes fail their checksum or their header is damaged."""

    code = "corrupt"


class BadRequestError(StoreError, ValueError):
    code = "bad_request"


class ServerBusyError(StoreError):
    """The server is at its connection or in-flight-bytes limit; retry later."""

    code = "busy"


class StoreIOError(StoreError, OSError):
    """Any other I/O failure on the server."""

    code = "io"


class ProtocolError(StoreError):
    """Malformed frame, unexpected EOF or a reply that does not match its request."""

    code = "protocol"


class PeerClosedError(ProtocolError):
    """The other side closed the connection (EOF) where a frame or payload was expected."""


class StoreConnectionError(StoreError, ConnectionError):
    """The connection to a server failed (refused, reset, timed out)."""

    code = "connection"


_BY_CODE: dict[str, type[StoreError]] = {
    cls.code: cls
    for cls in (
        MissingBlockError,
        BadKeyError,
        StoreFullError,
        CorruptBlockError,
        BadRequestError,
        ServerBusyError,
        StoreIOError,
        ProtocolError,
    )
}


def error_from_reply(reply: dict) -> StoreError:
    """Rebuild the typed exception a server reported in an error reply."""
    cls = _BY_CODE.get(str(reply.get("err")), StoreError)
    key = reply.get("key")
    return cls(str(reply.get("msg", "store error")), key=key if isinstance(key, str) else None)
