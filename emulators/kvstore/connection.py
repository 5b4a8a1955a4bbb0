"""The server's side of one connection: its state, the pooled receive buffers, a batch of mget replies and how blocks go out (sendfile), and the error frames that end a request or the connection."""
from __future__ import annotations

import os
import queue
import select
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from dualpath.store.errors import StoreError
from dualpath.store.protocol import MAX_MGET_KEYS, pack_frame
from dualpath.store.protocol import MAX_ID


class _ConnState:
    """A connection as the accept loop sees it: who, and since when it waits for a request."""

    __slots__ = ("sock", "peer", "idle_since", "evicted")

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer = sock, peer
        self.idle_since: float | None = None  # None: a request is being read or answered
        self.evicted = False


class _BufferPool:
    """A fixed set of chunk buffers: the server's bound on in-flight payload bytes."""

    def __init__(self, chunk_bytes: int, max_inflight_bytes: int) -> None:
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        for _ in range(max(1, max_inflight_bytes // chunk_bytes)):
            self._free.put(bytearray(chunk_bytes))

    def acquire(self, timeout: float) -> bytearray | None:
        try:
            return self._free.get(timeout=timeout)
        except queue.Empty:
            return None

    def release(self, buf: bytearray) -> None:
        self._free.put(buf)


class _CloseConnection(Exception):
    """The stream can no longer be trusted to be in sync: reply (if `reply`), then hang up."""

    def __init__(self, reply: StoreError | None = None, rid: int = -1) -> None:
        super().__init__(str(reply) if reply is not None else "")
        self.reply, self.rid = reply, rid


def _error_frame(rid: Any, err: StoreError) -> bytes:
    return pack_frame({"id": rid, "ok": False, "err": err.code, "msg": str(err), "key": err.key})


def _hang_up(conn: socket.socket, err: StoreError, rid: int = -1) -> None:
    """Send one error frame, then close without a RST destroying it: the client's unread bytes
    are read and dropped first (at most 0.5 s and 1 MiB). Best effort; never raises."""
    try:
        conn.settimeout(0.5)
        conn.sendall(_error_frame(rid, err))
        conn.shutdown(socket.SHUT_WR)
        deadline, drained = time.monotonic() + 0.5, 0
        while drained < (1 << 20) and time.monotonic() < deadline:
            chunk = conn.recv(65536)
            if not chunk:
                break
            drained += len(chunk)
    except OSError:
        pass


@dataclass
class _MgetBatch:
    """One mget's files, opened as their reads are started (read ahead) and sent in key order,
    each fd closed once used. Files are opened lazily so a connection holds at most
    MAX_FDS_AHEAD of them however many keys it asks for."""

    rid: int
    keys: list[Any]
    # items[:hinted]: an open fd, the error to reply, or None once handed on; the rest: not opened yet
    items: list[int | StoreError | None] = field(default_factory=list)
    hinted: int = 0  # items[:hinted] have been opened and had their reads started (in order)
    hinted_bytes: int = 0
    done_bytes: int = 0  # hinted bytes of the items already sent or answered
    sent: int = 0  # items[:sent] have been handed on
    sizes: list[int] = field(default_factory=list)  # bytes hinted per item, for items[:hinted]

    def close(self) -> None:
        for i, item in enumerate(self.items):
            self.items[i] = None
            if isinstance(item, int):
                os.close(item)


def _is_int(v: object) -> bool:
    return type(v) is int  # bool is an int subclass; True on the wire is a bug, not 1


def _is_mget(req: dict[str, Any]) -> bool:
    """A well-formed mget frame (the checks _handle and _mget make before serving one)."""
    rid, n, keys = req.get("id"), req.get("n", 0), req.get("keys")
    return (
        req.get("op") == "mget"
        and _is_int(rid)
        and 0 <= rid <= MAX_ID - MAX_MGET_KEYS
        and _is_int(n)
        and n == 0
        and isinstance(keys, list)
        and 0 < len(keys) <= MAX_MGET_KEYS
    )


def _sendfile_all(conn: socket.socket, fd: int, offset: int, count: int, timeout_s: float,
                  deadline: float | None = None) -> None:
    """Send `count` bytes of file `fd` from `offset` with sendfile(): page cache to socket, no user copy.

    The socket has a timeout (so it is non-blocking underneath); wait for
    writability with poll() on EAGAIN, at most timeout_s per wait, and give up
    at `deadline` (time.monotonic()) whatever the progress.
    """
    out = conn.fileno()
    poller = None
    while count > 0:
        try:
            sent = os.sendfile(out, fd, offset, count)
        except BlockingIOError:
            if poller is None:
                poller = select.poll()
                poller.register(out, select.POLLOUT)
            wait = timeout_s if deadline is None else min(timeout_s, deadline - time.monotonic())
            if wait <= 0 or not poller.poll(wait * 1000):
                raise TimeoutError("client stopped reading")
            continue
        if sent == 0:  # the file is shorter than its header said: the stream is now broken
            raise _CloseConnection()
        offset += sent
        count -= sent
