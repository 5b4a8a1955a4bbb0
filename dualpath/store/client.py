"""Store client: puts and batched gets of Full Blocks across striped servers.

Reads land straight in the caller's buffer: the header of each reply is read
separately, then the payload is recv_into() the caller's memoryview slice (no
intermediate copy), and its checksum is checked chunk by chunk as it lands,
while the bytes are still in cache (with the algorithm the server names for
the stored block: CRC-32C, or CRC-32 for blocks stored before it). Requests
are pipelined per server as mget frames (a window of outstanding requests,
never unbounded, so neither side can block on a full socket while the other
waits; the server reads a few MiB ahead of what it sends, on into the next
frame), and the groups of different servers run in parallel threads.

Faults: with `retry_s`, a block whose server could not be reached (refused, reset, closed, busy:
a server crashing and restarting) is asked for again, with backoff, until `retry_s` has passed;
what still fails then is reported as usual, so no call waits past about retry_s + timeout_s.
Blocks already read or written are never sent again. `link_up`, if given, says whether the
caller's own NIC works: while it is down nothing is retried (a read or write fails at once,
naming the NIC), and `interrupt()` cuts the connections in progress, so a read stalled on a
dead link ends at once instead of at the socket timeout.
"""
from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from dualpath.timeouts import scaled
from .checksum import ALGO_NAMES, HARDWARE_CRC32C, WRITE_ALGO, checksum, is_known_algo
from .errors import BadRequestError, PeerClosedError, ProtocolError, StoreConnectionError, StoreError, error_from_reply
from .keys import check_key
from .protocol import MAX_MGET_KEYS, pack_frame, parse_address
from .striping import group_by_server
from dualpath.store.connection import Buffer, T, _Connection, _CrcChecker, _Retry, _closed_by_peer, _corrupt, _first_error, _wire_error, retryable


MAX_HAS_KEYS = 1024  # the server's per-request limit


MAX_VERIFY_KEYS = 128  # ... and with verify (every payload is read)


WINDOW_BYTES = 32 << 20  # default bytes of outstanding get requests per server


class StoreClient:
    """Client of a striped set of storage servers holding Full Blocks of `block_bytes` each.

    `servers` is ordered: block placement depends on the position in the list. A node's pending
    reads (read_q) are counted by its read queue (dualpath/nodes/read_queue.py), not here.
    """

    def __init__(
        self,
        servers: Sequence[str | tuple[str, int]],
        block_bytes: int,
        *,
        timeout_s: float = scaled(30.0),
        window: int | None = None,
        crc_threads: int | None = None,
        retry_s: float = 0.0,
        link_up: Callable[[], bool] | None = None,
        link_name: str = "NIC",
    ) -> None:
        """`retry_s`: how long a block whose server is unreachable is retried (0: never);
        `link_up`: whether the caller's own NIC (`link_name`) works (see the module docstring)."""
        if not servers:
            raise ValueError("need at least one store server")
        if block_bytes <= 0:
            raise ValueError("block_bytes must be positive")
        if window is None:
            # About WINDOW_BYTES in flight per server: deep enough to keep a disk busy
            # on cold reads whatever the block size.
            window = max(8, min(MAX_MGET_KEYS, WINDOW_BYTES // block_bytes))
        if window < 1:
            raise ValueError("window must be >= 1")
        if not 0 <= retry_s < float("inf"):
            raise ValueError("retry_s must be a finite number of seconds >= 0")
        self.retry_s, self.link_up, self.link_name = retry_s, link_up, link_name
        self.retries = 0  # attempts after the first, over the client's life
        self.block_bytes = block_bytes
        self.window = window
        if crc_threads is None:
            crc_threads = 0 if HARDWARE_CRC32C else 1
        self.crc_threads = crc_threads  # 0: check CRCs inline on the receiving thread
        self._crc_pool: ThreadPoolExecutor | None = None
        self._conns = [_Connection(parse_address(s), timeout_s) for s in servers]
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @property
    def n_servers(self) -> int:
        return len(self._conns)

    def interrupt(self) -> None:
        """Cut every connection in progress (from any thread): an exchange blocked on it fails
        at once (and is retried only if the link is up). Called when the caller's NIC goes down."""
        for c in self._conns:
            s = c._sock
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _check_link(self, keys: Sequence[str]) -> None:
        """Fail at once, every key named, while the caller's own NIC is down."""
        if self.link_up is not None and keys and not self.link_up():
            err = StoreConnectionError(f"{self.link_name} is down: no store server is reachable")
            raise _first_error({i: err for i in range(len(keys))}, keys)

    def _retrying(self, positions: list[int], errors: dict[int, StoreError],
                  attempt: Callable[[list[int]], None]) -> None:
        """attempt(positions), then again for the positions whose error is retryable, until
        none is or the retry deadline passes (errors keeps the last attempt's)."""
        retry = _Retry(self.retry_s, self.link_up)
        todo = positions
        while True:
            attempt(todo)
            todo = [p for p in todo if retryable(errors.get(p))]
            if todo and self.link_up is not None and not self.link_up():
                down = StoreConnectionError(f"{self.link_name} went down: no store server is reachable")
                for p in todo:  # the cause, not the cut connection it left behind
                    errors[p] = down
                return
            if not todo or self.retry_s <= 0 or not retry.again():
                return
            self.retries += 1
            for p in todo:
                del errors[p]

    def close(self) -> None:
        with self._pool_lock:
            for pool in (self._pool, self._crc_pool):
                if pool is not None:
                    pool.shutdown(wait=True)
            self._pool = self._crc_pool = None
        for c in self._conns:
            with c.lock:
                c.reset()

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _crc_executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._crc_pool is None:
                self._crc_pool = ThreadPoolExecutor(max_workers=self.crc_threads, thread_name_prefix="store-crc")
            return self._crc_pool

    # ---- fan-out over servers -------------------------------------------
    def _run_groups(self, groups: dict[int, list[int]], work: Callable[[int, list[int]], T]) -> list[T]:
        """work(server, positions) for each group, in parallel when several servers are involved."""
        items = list(groups.items())
        if len(items) <= 1:
            return [work(s, pos) for s, pos in items]
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.n_servers, thread_name_prefix="store-client")
            pool = self._pool
        futures = [pool.submit(work, s, pos) for s, pos in items[1:]]
        results = [work(*items[0])]
        results.extend(f.result() for f in futures)
        return results

    # ---- writes ----------------------------------------------------------
    def put(self, key: str, data: Buffer) -> bool:
        """Store one block durably. True if written now (new, or replacing a damaged copy),
        False if an intact copy was already stored."""
        return self.put_many([(key, data)])[0]

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """Store blocks durably (acknowledged = fsynced and visible), pipelined per server.
        Per block: True if written now (new or repaired), False if already stored intact."""
        return [s != "exists" for s in self.put_status(items)]

    def put_status(self, items: Sequence[tuple[str, Buffer]]) -> list[str]:
        """put_many, telling per block "new", "repaired" (a stored copy failed its checks and
        these bytes replaced it) or "exists" (an intact copy was stored; nothing changed)."""
        views: list[memoryview] = []
        keys: list[str] = []
        for key, data in items:
            keys.append(check_key(key))
            view = memoryview(data).cast("B")
            if len(view) != self.block_bytes:
                raise BadRequestError(f"block {key} has {len(view)} bytes, store blocks are {self.block_bytes}", key=key)
            views.append(view)
        self._check_link(keys)
        status: list[str] = ["exists"] * len(keys)
        errors: dict[int, StoreError] = {}

        def work(server: int, positions: list[int]) -> None:
            conn = self._conns[server]

            def attempt(todo: list[int]) -> None:
                with conn.lock:
                    self._put_group(conn, todo, keys, views, status, errors)

            self._retrying(positions, errors, attempt)

        self._run_groups(group_by_server(keys, self.n_servers), work)
        if errors:
            raise _first_error(errors, keys)
        return status

    def _put_group(
        self,
        conn: _Connection,
        positions: list[int],
        keys: list[str],
        views: list[memoryview],
        status: list[str],
        errors: dict[int, StoreError],
    ) -> None:
        for attempt in (0, 1):
            ids: list[int] = []
            recvd = 0
            reused = False
            try:
                sock, reused = conn.begin()
                for i, pos in enumerate(positions):
                    # Keep at most `window` puts unanswered; replies are tiny, so this never deadlocks.
                    while i - recvd >= self.window:
                        self._put_reply(conn, ids[recvd], positions[recvd], status, errors)
                        recvd += 1
                    rid = conn.new_id()
                    ids.append(rid)
                    view = views[pos]
                    head = {"op": "put", "id": rid, "key": keys[pos], "n": len(view), "crc": checksum(view), "algo": WRITE_ALGO}
                    sock.sendall(pack_frame(head))
                    sock.sendall(view)
                while recvd < len(positions):
                    self._put_reply(conn, ids[recvd], positions[recvd], status, errors)
                    recvd += 1
                return
            except (OSError, StoreError) as exc:
                conn.reset()
                if attempt == 0 and reused and recvd == 0 and _closed_by_peer(exc):
                    continue  # closed while idle before any reply: puts are idempotent, send them again
                err = _wire_error(conn.address, exc)
                for pos in positions[recvd:]:
                    errors.setdefault(pos, err)
                return

    @staticmethod
    def _put_reply(conn: _Connection, rid: int, pos: int, status: list[str], errors: dict[int, StoreError]) -> None:
        reply = conn.read_reply(rid)
        if reply.get("ok"):
            status[pos] = "repaired" if reply.get("repaired") else "new" if reply.get("new") else "exists"
        else:
            errors[pos] = error_from_reply(reply)

    # ---- reads -----------------------------------------------------------
    def get(self, key: str) -> bytearray:
        out = bytearray(self.block_bytes)
        self.get_many([key], out)
        return out

    def get_many(self, keys: Sequence[str], out: Any, offsets: Sequence[int] | None = None) -> None:
        """Read blocks into `out` (any writable contiguous buffer: bytearray, memoryview,
        numpy array) at `offsets` (default: packed, i * block_bytes).

        All blocks that can be read are read; then the error of the first failed
        key is raised (MissingBlockError, CorruptBlockError, ...) with every
        failure in its `.errors` dict (key -> error). Bytes at a failed offset
        are unspecified. A caller that counts blocks as hits treats a key in
        `.errors` with MissingBlockError or CorruptBlockError as a miss (recompute
        it, then put it again: a put of the right bytes repairs a damaged block).
        """
        keys = [check_key(k) for k in keys]
        mv = memoryview(out)
        if mv.readonly:
            raise ValueError("get_many needs a writable buffer")
        if not mv.contiguous:
            raise ValueError("get_many needs a contiguous buffer")
        mv = mv.cast("B")
        bb = self.block_bytes
        offs = list(offsets) if offsets is not None else [i * bb for i in range(len(keys))]
        if len(offs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(offs)} offsets")
        for off in offs:
            if not 0 <= off <= len(mv) - bb:
                raise ValueError(f"offset {off} + block {bb} outside buffer of {len(mv)} bytes")
        ordered = sorted(offs)
        if any(b - a < bb for a, b in zip(ordered, ordered[1:])):
            raise ValueError("offsets overlap: blocks would overwrite each other")
        if not keys:
            return
        views = [mv[off : off + bb] for off in offs]
        self._check_link(keys)
        errors: dict[int, StoreError] = {}

        def work(server: int, positions: list[int]) -> None:
            conn = self._conns[server]

            def attempt(todo: list[int]) -> None:
                with conn.lock:
                    self._get_group(conn, todo, keys, views, errors)

            self._retrying(positions, errors, attempt)

        self._run_groups(group_by_server(keys, self.n_servers), work)
        if errors:
            raise _first_error(errors, keys)

    def _get_group(
        self,
        conn: _Connection,
        positions: list[int],
        keys: list[str],
        views: list[memoryview],
        errors: dict[int, StoreError],
    ) -> None:
        bb = self.block_bytes
        checker = _CrcChecker(self._crc_executor()) if self.crc_threads and len(positions) > 1 else None
        ids: list[int] = []
        sent = recvd = 0
        try:
            for attempt in (0, 1):
                ids, sent, recvd = [], 0, 0
                reused = replied = False
                try:
                    sock, reused = conn.begin()
                    while recvd < len(positions):
                        # Refill the window in one send once half of it has been answered.
                        if sent < len(positions) and sent - recvd <= self.window // 2:
                            # One mget frame per refill: the server reads ahead across the batch, and on
                            # into this frame while it still sends the previous one.
                            upto = min(len(positions), recvd + self.window, sent + MAX_MGET_KEYS)
                            first = conn.new_id()
                            for _ in range(sent + 1, upto):
                                conn.new_id()
                            ids.extend(range(first, first + upto - sent))
                            sock.sendall(pack_frame({"op": "mget", "id": first, "keys": [keys[p] for p in positions[sent:upto]]}))
                            sent = upto
                        pos = positions[recvd]
                        reply = conn.read_reply(ids[recvd])
                        replied = True
                        if not reply.get("ok"):
                            errors[pos] = error_from_reply(reply)
                            recvd += 1
                            continue
                        n = reply.get("n")
                        if n != bb:
                            raise ProtocolError(f"block {keys[pos]}: server sent {n!r} bytes, store blocks are {bb}")
                        algo = reply.get("algo")
                        if not is_known_algo(algo):
                            # Never read a block unchecked: a v1 server names no algo, a newer one may name one we lack.
                            raise ProtocolError(f"block {keys[pos]}: reply names checksum algo {algo!r}, known: {ALGO_NAMES}")
                        # Payload straight into the caller's buffer.
                        view, crc, got = views[pos], 0, 0
                        while got < bb:
                            k = sock.recv_into(view[got:], bb - got)
                            if k == 0:
                                raise PeerClosedError(f"connection closed after {got} of {bb} payload bytes")
                            if checker is None:  # inline: CRC each chunk while it is hot in cache
                                crc = checksum(view[got : got + k], algo, crc)
                            got += k
                        if checker is None:
                            if crc != reply.get("crc"):
                                errors[pos] = _corrupt(keys[pos])
                        else:
                            checker.add(pos, view, algo, reply.get("crc"))
                        recvd += 1
                    return
                except (OSError, StoreError) as exc:
                    conn.reset()
                    if attempt == 0 and reused and not replied and _closed_by_peer(exc):
                        continue  # closed while idle before any reply: ask again on a new connection
                    err = _wire_error(conn.address, exc)
                    for p in positions[recvd:]:
                        errors.setdefault(p, err)
                    return
        finally:
            if checker is not None:
                for p in checker.finish():  # every received block is checked, even after an error
                    errors.setdefault(p, _corrupt(keys[p]))

    # ---- metadata --------------------------------------------------------
    def contains(self, keys: Sequence[str], verify: bool = False) -> list[bool]:
        """Which of `keys` are stored intact (one round trip per server per 1024 keys).

        The server checks each block's header and size (cheap: a damaged header or a
        truncated file is not "stored"); `verify` also checks each payload's CRC on the
        server, which reads every block (128 keys per round trip). Without it a block whose
        payload bits flipped on disk still counts, and its read raises CorruptBlockError.
        """
        keys = [check_key(k) for k in keys]
        have = [False] * len(keys)
        per_call = MAX_VERIFY_KEYS if verify else MAX_HAS_KEYS
        extra = {"verify": True} if verify else {}

        self._check_link(keys)

        def work(server: int, positions: list[int]) -> None:
            conn = self._conns[server]
            for start in range(0, len(positions), per_call):
                chunk = positions[start : start + per_call]
                reply = self._call_retrying(conn, {"op": "has", "keys": [keys[p] for p in chunk], **extra})
                flags = reply.get("have")
                if not isinstance(flags, list) or len(flags) != len(chunk):
                    raise ProtocolError("malformed has reply")
                for p, f in zip(chunk, flags):
                    have[p] = bool(f)

        self._run_groups(group_by_server(keys, self.n_servers), work)
        return have

    def _call_retrying(self, conn: _Connection, header: dict[str, Any]) -> dict[str, Any]:
        """conn.call(header), retried like blocks are while the server is unreachable."""
        retry = _Retry(self.retry_s, self.link_up)
        while True:
            try:
                with conn.lock:
                    return conn.call(header)
            except StoreError as e:
                if not retryable(e) or self.retry_s <= 0 or not retry.again():
                    raise
                self.retries += 1

    def delete(self, key: str) -> bool:
        conn = self._conns[group_by_server([check_key(key)], self.n_servers).popitem()[0]]
        return bool(self._call_retrying(conn, {"op": "delete", "key": key}).get("deleted"))

    def stats(self) -> list[dict[str, Any]]:
        """Per-server usage, in server order."""
        out = []
        for conn in self._conns:
            with conn.lock:
                out.append({k: v for k, v in conn.call({"op": "stat"}).items() if k not in ("id", "ok")})
        return out
