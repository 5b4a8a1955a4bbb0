"""A node's read queue: bytes requested from the store but not yet received.

The scheduler (DESIGN.md section 8) compares read_q across nodes to pick the
read path, so every store client on a node shares one ReadQueue and it must be
exact under concurrency: all updates happen under one lock.
"""
from __future__ import annotations

import threading


class ReadQueue:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = 0

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return self._pending

    def __int__(self) -> int:
        return self.pending_bytes

    def add(self, n: int) -> None:
        """Bytes just requested (or committed to be requested)."""
        if n < 0:
            raise ValueError("add() takes a non-negative byte count")
        with self._lock:
            self._pending += n

    def done(self, n: int) -> None:
        """Bytes received, or given up on after an error."""
        if n < 0:
            raise ValueError("done() takes a non-negative byte count")
        with self._lock:
            if n > self._pending:
                # An accounting bug must not go unnoticed, nor drive read_q negative.
                pending, self._pending = self._pending, 0
                raise RuntimeError(f"read_q underflow: done({n}) with {pending} pending")
            self._pending -= n
