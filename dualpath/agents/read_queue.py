"""A node's storage read queue: loads are accepted on arrival and run in order by one worker.

The scheduler's read-path rule compares the bytes each node still has to read (read_q). If
loads waited outside the node, in the conductor, to be sent one at a time, the node could
only count the one in progress and the queue would look empty. So the host agent takes every
load as it arrives on this socket (a ROUTER: many outstanding per client), counts its bytes at
once, and one worker thread reads them FIFO through the node's store client, as its one SNIC
would. Each reply carries the request's id (dualpath.control.AsyncRpcClient matches them).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import zmq
from pydantic import ConfigDict, ValidationError, validate_call

from dualpath.control import MAX_MSG_BYTES, RequestError, one_line, pack, short, unpack, unpack_request

MAX_LOG = 200_000  # loads remembered between two drains
MAX_LOAD_KEYS = 1 << 16  # blocks per load (a load fills consecutive slots of one buffer)
MAX_KEY_CHARS = 64  # a store key is 32 hex digits


class ReadQueueServer:
    def __init__(self, endpoint: str, block_bytes: int, load: Callable[[list[str], int], dict],
                 check: Callable[[list[str], int], None] | None = None) -> None:
        """`load(keys, offset)` reads Full Blocks into the buffer (the host agent's store read);
        `check(keys, offset)` validates a load's arguments on arrival (raise ValueError), so a
        bad one is refused at once, never queued or counted in read_q."""
        self.endpoint, self.block_bytes = endpoint, block_bytes
        self._load = load
        self._check = check
        self._lock = threading.Lock()
        self._pending = 0
        self._work: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._done_ep = f"inproc://read-queue-{id(self)}"
        self._log: list[tuple[float, float, int]] = []  # (start, end, bytes) of every load read

    def drain_log(self) -> list[tuple[float, float, int]]:
        """Every load read since the last call, as (accepted, finished, bytes): while a load is
        accepted and not finished, the node has pending reads and its SNIC should be busy."""
        with self._lock:
            out, self._log = self._log, []
        return out

    @property
    def pending_bytes(self) -> int:
        """Bytes of loads accepted and not finished: the node's read_q."""
        with self._lock:
            return self._pending

    def start(self, max_seconds: float = 24 * 3600) -> "ReadQueueServer":
        self._ctx = zmq.Context()
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(max_seconds, ready), name="read-queue", daemon=True).start()
        ready.wait(10)
        threading.Thread(target=self._worker, name="read-worker", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._work.put(None)

    # -- serving thread: owns the ROUTER socket --------------------------------------------------
    def _serve(self, max_seconds: float, ready: threading.Event) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MSG_BYTES)
        sock.bind(self.endpoint)
        done = self._ctx.socket(zmq.PULL)
        done.bind(self._done_ep)
        ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(done, zmq.POLLIN)
        deadline = time.monotonic() + max_seconds
        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                events = dict(poller.poll(200))
                if done in events:
                    ident, reply = unpack(done.recv())
                    sock.send_multipart([ident, b"", pack(reply)])
                if sock in events:
                    frames = sock.recv_multipart()
                    ident, reply = frames[0], self._accept(frames[-1], frames[0])
                    if reply is not None:  # refused at once; accepted loads reply from the worker
                        sock.send_multipart([ident, b"", pack(reply)])
        finally:
            sock.close()
            done.close()

    def _accept(self, payload: bytes, ident: bytes) -> dict | None:
        """Queue a load, or the error reply (one line naming the field) to send at once."""
        try:
            msg = unpack_request(payload)
        except RequestError as e:
            return {"ok": False, "id": None, "error": one_line(str(e))}
        rid = msg.get("id") if isinstance(msg, dict) else None
        if type(rid) is not int:  # replies are matched by an integer id; echo nothing else
            rid = None
        if not isinstance(msg, dict) or msg.get("cmd") != "load" or not isinstance(msg.get("args"), dict):
            return {"ok": False, "id": rid, "error": "the read queue serves {'cmd': 'load', 'args': {...}, 'id': ...}"}
        args = msg["args"]
        if any(not isinstance(k, str) for k in args):
            return {"ok": False, "id": rid, "error": "load: argument names must be strings"}
        try:
            keys, offset = _check_load(**args)
            if self._check is not None:
                self._check(keys, offset)
        except ValidationError as e:
            err = e.errors()[0]
            field = one_line(".".join(map(str, err["loc"])), 80)
            return {"ok": False, "id": rid, "error": one_line(f"load: field '{field}': {err['msg']}")}
        except (TypeError, ValueError) as e:
            return {"ok": False, "id": rid, "error": one_line(f"load: {e}")}
        nbytes = len(keys) * self.block_bytes
        with self._lock:
            self._pending += nbytes
        self._work.put((ident, rid, keys, offset, nbytes, time.monotonic()))
        return None

    # -- worker thread: one load at a time, in arrival order --------------------------------------
    def _worker(self) -> None:
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(self._done_ep)
        try:
            while (item := self._work.get()) is not None:
                ident, rid, keys, offset, nbytes, t_accepted = item
                try:
                    reply = {"ok": True, "id": rid, **self._load(keys, offset)}
                except Exception as e:  # a failed load must not take the queue down
                    reply = {"ok": False, "id": rid, "error": f"load: {type(e).__name__}: {e}"}
                finally:
                    with self._lock:
                        self._pending -= nbytes
                        if len(self._log) < MAX_LOG:
                            self._log.append((t_accepted, time.monotonic(), nbytes))
                push.send(pack([ident, reply]))
        finally:
            push.close()


@validate_call(config=ConfigDict(strict=True))
def _check_load(keys: list[str], offset: int) -> tuple[list[str], int]:
    """A load's arguments by type (strict: no "5" for 5, no true for 1) and by size."""
    if len(keys) > MAX_LOAD_KEYS:
        raise ValueError(f"field 'keys': {len(keys)} keys, at most {MAX_LOAD_KEYS} per load")
    for i, k in enumerate(keys):
        if len(k) > MAX_KEY_CHARS:
            raise ValueError(f"field 'keys': entry {i} is {short(k)}, not a block key")
    if offset < 0:
        raise ValueError(f"field 'offset' must be >= 0, got {offset}")
    return keys, offset
