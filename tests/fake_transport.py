"""An in-memory stand-in for the NIXL transport agent, for connector tests without root.

Peers' registered regions are numpy arrays in one `FakeNet`. A READ copies remote bytes into the
local region when it is posted and is done at once. A WRITE can be made to land late, as UCX's TCP
transport does: its completion is reported before (some of) its bytes are applied at the target,
and they land only after a number of later polls of the net. It moves real bytes; only the wire
is missing. This is test scaffolding, not a transport the testbed runs on.
"""
from __future__ import annotations

import numpy as np


class FakeNet:
    def __init__(self) -> None:
        self.regions: dict[tuple[str, str], np.ndarray] = {}
        self._late: list[list] = []  # [polls left, apply()] of WRITEs reported done but not landed
        self.late_writes = 0  # the next this many WRITEs land `late_polls` polls after their completion
        self.late_polls = 3
        self.landing = True  # False holds late WRITEs back however often the net is polled
        self.posted: list[tuple[str, str, str, int]] = []  # (op, peer, region, bytes)

    def region(self, peer: str, name: str, nbytes: int) -> np.ndarray:
        return self.regions.setdefault((peer, name), np.zeros(nbytes, dtype=np.uint8))

    def tick(self) -> None:
        if not self.landing:
            return
        still = []
        for item in self._late:
            item[0] -= 1
            if item[0] <= 0:
                item[1]()
            else:
                still.append(item)
        self._late = still


class FakeTransfer:
    def __init__(self, net: FakeNet) -> None:
        self.net = net

    def poll(self) -> bool:
        self.net.tick()
        return True

    def wait(self, timeout: float | None = None) -> None:
        self.net.tick()


class FakeAgent:
    """One peer's agent: `post` READs/WRITEs between its own region and a peer's."""

    def __init__(self, name: str, net: FakeNet, region: str, nbytes: int) -> None:
        self.name, self.net = name, net
        self.local = net.region(name, region, nbytes)
        self.notifs: list[tuple[str, str]] = []  # (peer, message) sent with WRITEs

    def post(self, op: str, peer: str, local: str, remote: str, descs, layer=None, notif=None) -> FakeTransfer:
        rem = self.net.regions[(peer, remote)]
        d = np.asarray(descs, dtype=np.int64).reshape(-1, 3)
        self.net.posted.append((op, peer, remote, int(d[:, 2].sum())))
        if op == "READ":
            for lo, ro, n in d:
                self.local[lo:lo + n] = rem[ro:ro + n]
        else:
            data = [(ro, self.local[lo:lo + n].copy()) for lo, ro, n in d]

            def apply() -> None:
                for ro, b in data:
                    rem[ro:ro + len(b)] = b

            if self.net.late_writes:
                self.net.late_writes -= 1
                self.net._late.append([self.net.late_polls, apply])
            else:
                apply()
            if notif is not None:
                self.notifs.append((peer, notif))
        return FakeTransfer(self.net)
