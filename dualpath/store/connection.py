"""What a store client is made of below its calls: one connection to one server (frames, timeouts), the bounded retry of a restarting server, and the CRC check of what arrives."""
from __future__ import annotations

import select
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence, TypeVar

from .checksum import checksum
from .errors import CorruptBlockError, PeerClosedError, ProtocolError, ServerBusyError, StoreConnectionError, StoreError, error_from_reply
from .protocol import pack_frame, recv_header


Buffer = bytes | bytearray | memoryview


T = TypeVar("T")


RETRY_FIRST_S = 0.05  # the first backoff between attempts; it doubles up to RETRY_MAX_S


RETRY_MAX_S = 1.0


class _Connection:
    """One TCP connection to one server. Callers hold `lock` around any use."""

    def __init__(self, address: tuple[str, int], timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._next_id = 0

    def sock(self) -> socket.socket:
        if self._sock is None:
            try:
                s = socket.create_connection(self.address, timeout=self.timeout_s)
            except OSError as exc:
                raise StoreConnectionError(f"cannot connect to store server {self.address}: {exc}") from None
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = s
        return self._sock

    def begin(self) -> tuple[socket.socket, bool]:
        """The socket for a new exchange, and whether it served earlier ones.

        Servers close connections that sit idle (and may close an idle one to admit
        another client): an idle socket that has become readable holds only that EOF,
        so it is replaced here. One closed in the instant before a request goes out is
        seen as a failed exchange on a reused socket, which callers retry once.
        """
        if self._sock is not None:
            p = select.poll()
            p.register(self._sock, select.POLLIN | select.POLLERR | select.POLLHUP)
            if p.poll(0):
                self.reset()
        reused = self._sock is not None
        return self.sock(), reused

    def reset(self) -> None:
        """Drop the connection: after any wire error the stream may be out of sync."""
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def read_reply(self, expect_id: int) -> dict[str, Any]:
        reply = recv_header(self.sock())
        assert reply is not None
        rid = reply.get("id")
        if rid != expect_id:
            if reply.get("ok") is False and rid == -1:
                raise error_from_reply(reply)  # refused before any request (busy)
            raise ProtocolError(f"reply id {rid!r} does not match request {expect_id}")
        return reply

    def call(self, header: dict[str, Any]) -> dict[str, Any]:
        """One request without payload, one reply without payload."""
        for attempt in (0, 1):
            reused = False
            rid = self.new_id()
            try:
                sock, reused = self.begin()
                sock.sendall(pack_frame({**header, "id": rid}))
                reply = self.read_reply(rid)
                break
            except (OSError, ProtocolError) as exc:
                self.reset()
                if attempt == 0 and reused and _closed_by_peer(exc):
                    continue  # the server had closed it while idle: once more on a new connection
                raise _wire_error(self.address, exc) from None
            except StoreError:
                self.reset()
                raise
        if not reply.get("ok"):
            raise error_from_reply(reply)
        return reply


def _closed_by_peer(exc: BaseException) -> bool:
    """A failure that means the server had closed the connection (not a reply, not a timeout)."""
    return isinstance(exc, (PeerClosedError, ConnectionResetError, BrokenPipeError, ConnectionAbortedError))


def _wire_error(address: tuple[str, int], exc: BaseException) -> StoreError:
    if isinstance(exc, StoreError):
        return exc
    return StoreConnectionError(f"store server {address}: {exc}")


def retryable(err: BaseException | None) -> bool:
    """An error that a later attempt may not meet: the server was unreachable, closed the
    connection, or was busy (not a missing or corrupt block, a bad request or a full disk)."""
    return isinstance(err, (StoreConnectionError, PeerClosedError, ServerBusyError))


class _Retry:
    """Backoff within one deadline: `again()` sleeps before the next attempt, or says there
    is none (the deadline would pass, or the caller's link is down)."""

    def __init__(self, retry_s: float, link_up: Callable[[], bool] | None) -> None:
        self.deadline = time.monotonic() + retry_s
        self.delay = RETRY_FIRST_S
        self.link_up = link_up
        self.attempts = 1

    def again(self) -> bool:
        if self.link_up is not None and not self.link_up():
            return False
        left = self.deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(self.delay, left))
        self.delay = min(2 * self.delay, RETRY_MAX_S)
        self.attempts += 1
        return True


def _corrupt(key: str) -> CorruptBlockError:
    return CorruptBlockError(f"block {key}: payload checksum mismatch on read", key=key)


class _CrcChecker:
    """Checks received blocks' CRCs on helper threads while the socket thread keeps receiving.

    Worth it only where the checksum is slow (software CRC-32C, or CRC-32 at
    ~4 GB/s): overlapping it with the receive copy then puts a second core to
    use. With hardware CRC-32C (~15 GB/s) checking inline, while the chunk is
    still in cache, is faster here (cold reads 1.26 vs 1.10 GB/s, two cores),
    so that is the default. Both checksum implementations release the GIL on large
    buffers. Small blocks are grouped into tasks of >= TASK_BYTES so task
    overhead stays negligible.
    """

    TASK_BYTES = 1 << 20

    def __init__(self, executor: ThreadPoolExecutor) -> None:
        self._executor = executor
        self._batch: list[tuple[int, memoryview, int, Any]] = []
        self._batch_bytes = 0
        self._futures: list[Future[list[int]]] = []

    def add(self, pos: int, view: memoryview, algo: int, expected: Any) -> None:
        self._batch.append((pos, view, algo, expected))
        self._batch_bytes += len(view)
        if self._batch_bytes >= self.TASK_BYTES:
            self._submit()

    def _submit(self) -> None:
        if self._batch:
            self._futures.append(self._executor.submit(_bad_crcs, self._batch))
            self._batch, self._batch_bytes = [], 0

    def finish(self) -> list[int]:
        """Positions whose CRC did not match."""
        self._submit()
        return [p for f in self._futures for p in f.result()]


def _bad_crcs(batch: list[tuple[int, memoryview, int, Any]]) -> list[int]:
    return [pos for pos, view, algo, expected in batch if checksum(view, algo) != expected]


def _first_error(errors: dict[int, StoreError], keys: Sequence[str]) -> StoreError:
    """The error of the earliest failed position, carrying all of them in .errors (key -> error)."""
    first = errors[min(errors)]
    first.errors = {keys[pos]: err for pos, err in sorted(errors.items())}  # type: ignore[attr-defined]
    return first
