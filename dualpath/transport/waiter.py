"""Many threads waiting for peers' notifications on one agent, with one pump pulling for all.

A host agent waits for many requests' notifications at once (every PE WRITE toward its buffer,
every decode write-back). If each waiter polled NIXL itself, the polls would multiply with the
waiters; here one pump thread pulls the agent's notifications about once a millisecond while
anyone waits (and sleeps otherwise), and wakes the waiters whose message came.
"""
from __future__ import annotations

import threading
import time

from dualpath.transport.base import NotificationInbox, TransferTimeout

PUMP_EVERY_S = 0.001


class NotificationWaiter:
    def __init__(self, inbox: NotificationInbox, every_s: float = PUMP_EVERY_S) -> None:
        self.inbox, self.every_s = inbox, every_s
        self._cond = threading.Condition()
        self._box: dict[str, list[bytes]] = {}
        self._waiting = 0
        self._stop = False
        threading.Thread(target=self._pump, name="notif-pump", daemon=True).start()

    def wait(self, peer: str, msg: bytes | str, timeout_s: float) -> None:
        """Until `peer` has sent `msg` (consumed), or TransferTimeout after timeout_s."""
        want = msg.encode() if isinstance(msg, str) else msg
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._waiting += 1
            self._cond.notify_all()  # the pump starts pulling
            try:
                while True:
                    box = self._box.get(peer, [])
                    if want in box:
                        box.remove(want)
                        return
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TransferTimeout(f"agent {self.inbox.name!r}: no notification {want!r} from peer "
                                              f"{peer!r} within {timeout_s:.1f} s (got {box[:5]})")
                    self._cond.wait(left)
            finally:
                self._waiting -= 1

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def _pump(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
            got = self.inbox.get_notifs()
            if got:
                with self._cond:
                    for peer, msgs in got.items():
                        self._box.setdefault(peer, []).extend(msgs)
                    self._cond.notify_all()
            time.sleep(self.every_s)
