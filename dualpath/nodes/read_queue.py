"""A node's storage read queue: loads are accepted on arrival and run in order by one worker.

The scheduler's read-path rule compares the bytes each node still has to read (read_q). If
loads waited outside the node, in the conductor, to be sent one at a time, the node could
only count the one in progress and the queue would look empty. So the host agent takes every
load as it arrives on this socket (a ROUTER: many outstanding per client), counts its bytes at
once, and one worker thread reads them FIFO through the node's store client, as its one SNIC
would. Each reply carries the request's id (dualpath.control.AsyncRpcClient matches them).
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from pydantic import ConfigDict, ValidationError, validate_call

from dualpath.control import Auth, RouterServer, one_line, short

MAX_LOG = 200_000  # loads remembered between two drains
MAX_LOAD_KEYS = 1 << 16  # blocks per load (a load fills consecutive slots of one buffer)
MAX_KEY_CHARS = 64  # a store key is 32 hex digits


class ReadQueueServer:
    def __init__(self, endpoint: str, block_bytes: int, load: Callable[[list[str], int], dict],
                 check: Callable[[list[str], int], None] | None = None, auth: Auth | None = None) -> None:
        """`load(keys, offset)` reads Full Blocks into the buffer (the host agent's store read);
        `check(keys, offset)` validates a load's arguments on arrival (raise ValueError), so a
        bad one is refused at once, never queued or counted in read_q."""
        self.endpoint, self.block_bytes = endpoint, block_bytes
        self._check = check
        self._lock = threading.Lock()
        self._pending = 0
        self._accepted: dict[int, float] = {}  # id(args) of a queued load -> when it arrived
        self._log: list[tuple[float, float, int]] = []
        self._server = RouterServer(endpoint, {"load": load}, workers=1, admit=self._admit, done=self._done,
                                    name="read-queue", auth=auth)

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
        self._server.start(max_seconds)
        return self

    def stop(self) -> None:
        self._server.stop()

    def _admit(self, cmd: str, args: dict) -> None:
        try:
            keys, offset = _check_load(**args)
        except ValidationError as e:
            err = e.errors()[0]
            raise ValueError(f"field '{one_line('.'.join(map(str, err['loc'])), 80)}': {err['msg']}") from None
        if self._check is not None:
            self._check(keys, offset)
        with self._lock:
            self._pending += len(keys) * self.block_bytes
            self._accepted[id(args)] = time.monotonic()

    def _done(self, cmd: str, args: dict) -> None:
        nbytes = len(args["keys"]) * self.block_bytes
        with self._lock:
            self._pending -= nbytes
            t0 = self._accepted.pop(id(args))
            if len(self._log) < MAX_LOG:
                self._log.append((t0, time.monotonic(), nbytes))


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
