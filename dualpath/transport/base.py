"""What every KV transport shares, whatever moves the bytes: registered regions, descriptor lists, a posted transfer and its bounded wait, notifications, and the TransportAgent interface that NIXL's Agent (agent.py) and Mooncake's (mooncake.py) implement."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from dualpath.timeouts import scaled
from .env import TransportError


DEFAULT_TIMEOUT_S = scaled(60.0)


KINDS = ("dram", "hbm")  # both are host memory on this machine; NIXL sees DRAM_SEG


MAX_POLL_SLEEP_S = 0.001  # a waiting transfer is polled at least this often


class TransferTimeout(TransportError):
    """A transfer did not complete in time."""


class TransferFailed(TransportError):
    """NIXL reported an error for a transfer."""


def _buffer_addr_len(buf: Any) -> tuple[int, int]:
    """(address, nbytes) of a contiguous host buffer: numpy array or torch CPU tensor."""
    if isinstance(buf, np.ndarray):
        if not buf.flags["C_CONTIGUOUS"]:
            raise TransportError("region buffer must be C-contiguous")
        return int(buf.ctypes.data), int(buf.nbytes)
    if hasattr(buf, "data_ptr") and hasattr(buf, "element_size"):  # torch.Tensor, no import
        if buf.device.type != "cpu":
            raise TransportError(f"only host (cpu) tensors can be registered here, got {buf.device}")
        if not buf.is_contiguous():
            raise TransportError("region tensor must be contiguous")
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size())
    raise TransportError(f"cannot register {type(buf).__name__}: use a numpy array or torch CPU tensor")


@dataclass(frozen=True)
class Region:
    """A registered region (local: `buf` is kept alive; remote: `buf` is None)."""
    name: str
    kind: str
    addr: int
    nbytes: int
    buf: Any = field(default=None, repr=False, compare=False)


@dataclass
class TransferStats:
    op: str
    peer: str
    layer: Any
    ndesc: int
    nbytes: int
    requests: int  # NIXL requests posted: 1 when batched, ndesc one by one
    post_s: float  # time to create + post every request
    total_s: float  # post start to completion seen
    traffic_class: str = ""  # the class of the agent that carried it (its DSCP on the wire)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.total_s / 1e9 if self.total_s > 0 else float("inf")


class Transfer:
    """An in-flight transfer: one NIXL request (batched) or one per descriptor."""

    def __init__(self, agent: "Agent", op: str, peer: str, layer: Any, handles: list,
                 ndesc: int, nbytes: int, t0: float, t_posted: float, notif: bytes | None,
                 notif_after: bool):
        self.agent, self.op, self.peer, self.layer = agent, op, peer, layer
        self.handles = handles
        self.ndesc, self.nbytes = ndesc, nbytes
        self.t0, self.t_posted = t0, t_posted
        self._pending = list(range(len(handles)))
        self._notif = notif
        self._notif_after = notif_after  # one-by-one mode: send the notification once all landed
        self.done = False
        self.stats: TransferStats | None = None

    def _what(self) -> str:
        lay = f" layer {self.layer}" if self.layer is not None else ""
        return f"{self.op} with peer {self.peer!r}{lay} ({self.ndesc} descriptors, {self.nbytes} bytes)"

    def poll(self) -> bool:
        """Check completion once; True when every request is done."""
        if self.done:
            return True
        nx = self.agent._nx
        still = []
        for i in self._pending:
            st = nx.check_xfer_state(self.handles[i])
            if st == "ERR":
                self._release()
                raise TransferFailed(f"{self._what()} failed in NIXL/UCX")
            if st != "DONE":
                still.append(i)
        self._pending = still
        if still:
            return False
        t1 = time.perf_counter()
        if self._notif_after and self._notif is not None:
            nx.send_notif(self.peer, self._notif)
        self._release()
        self._finish(t1)
        return True

    def _finish(self, t1: float) -> None:
        """Mark done, count the payload in the agent's `moved` and record the stats."""
        self.done = True
        moved = getattr(self.agent, "moved", None)
        if moved is not None:
            moved[self.op] = moved.get(self.op, 0) + self.nbytes
        tc = getattr(self.agent, "traffic_class", None)
        self.stats = TransferStats(self.op, self.peer, self.layer, self.ndesc, self.nbytes,
                                   len(self.handles), self.t_posted - self.t0, t1 - self.t0,
                                   tc.name if tc is not None else "")

    def wait(self, timeout: float | None = None, poll_sleep_s: float | None = None) -> TransferStats:
        """Wait for completion, at most `timeout` seconds (default: the agent's)."""
        timeout = self.agent.timeout_s if timeout is None else timeout
        sleep = self.agent.poll_sleep_s if poll_sleep_s is None else poll_sleep_s
        deadline = time.monotonic() + timeout
        while not self.poll():
            if time.monotonic() > deadline:
                self._release()
                raise TransferTimeout(
                    f"{self._what()} did not complete within {timeout:.1f} s "
                    f"(transport {self.agent.transport_in_use}); is the peer alive and reachable?")
            if sleep:
                time.sleep(sleep)
                # back off: a short transfer is seen at once, a long one costs few polls (each
                # progresses UCX, tens of microseconds of CPU on cores the NICs' emulation needs)
                sleep = min(sleep * 2, MAX_POLL_SLEEP_S)
        assert self.stats is not None
        return self.stats

    def _release(self) -> None:
        for h in self.handles:
            try:
                h.release()
            except Exception:  # in-flight handles cannot always be aborted; NIXL keeps them
                pass


class NotificationInbox:
    """Notifications by sender, for an agent that fills `_notifs` in `_pull_notifs()`.

    Safe to wait on from several threads at once (a host agent waits for many requests'
    notifications concurrently): one lock guards pulling and taking."""

    name: str
    timeout_s: float
    _notifs: dict[str, list[bytes]]
    _where = ""  # said in a timeout's message: where the inbox looked

    def _lock(self) -> threading.Lock:
        return self.__dict__.setdefault("_inbox_lock", threading.Lock())  # atomic: one per inbox

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _pull_notifs(self) -> None:
        raise NotImplementedError

    def progress(self) -> None:
        """Advance this agent's UCX worker once (an agent without a progress thread calls it
        when idle).

        UCX's TCP connection setup needs both sides to progress. NIXL opens an endpoint to every
        peer whose metadata it loads, so a peer that never progresses leaves those endpoints
        half set up, waiting for socket writability: their owner's progress thread then finds
        its event fd ready on every poll and spins a whole core (measured here: both cores
        taken by two idle host agents until the engines progressed).
        """
        with self._lock():
            self._pull_notifs()

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Every notification received since the last call, by sender name."""
        with self._lock():
            self._pull_notifs()
            out = {p: m for p, m in self._notifs.items() if m}
            self._notifs = {}
        return out

    def wait_notif(self, peer: str, msg: bytes | str, *, prefix: bool = False,
                   timeout: float | None = None) -> bytes:
        """Wait for a notification from `peer` equal to (or starting with) `msg`; consume it."""
        want = msg.encode() if isinstance(msg, str) else msg
        timeout = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            with self._lock():
                self._pull_notifs()
                box = self._notifs.get(peer, [])
                for i, m in enumerate(box):
                    if m == want or (prefix and m.startswith(want)):
                        return box.pop(i)
                box = list(box)
            if time.monotonic() > deadline:
                raise TransferTimeout(
                    f"agent {self.name!r}: no notification {want!r} from peer {peer!r} within "
                    f"{timeout:.1f} s{self._where} (got {[bytes(m) for m in box][:5]})")
            time.sleep(0.0005)


class TransportAgent(NotificationInbox):
    """What every KV transport agent shares (NIXL's Agent, MooncakeAgent): its regions, its
    peers' regions, and READ/WRITE as post-and-wait. A subclass fills `_regions` and `_peers`
    and implements `post`."""

    _regions: dict[str, Region]
    _peers: dict[str, dict[str, Region]]

    def region(self, name: str) -> Region:
        return self._regions[name]

    def peers(self) -> list[str]:
        return list(self._peers)

    def remote_region(self, peer: str, name: str) -> Region:
        try:
            regions = self._peers[peer]
        except KeyError:
            raise TransportError(f"agent {self.name!r}: unknown peer {peer!r} (add_peer first)") from None
        try:
            return regions[name]
        except KeyError:
            raise TransportError(f"peer {peer!r} has no region {name!r} (has {sorted(regions)}); "
                                 f"was it registered before its metadata was sent?") from None

    def post(self, op: str, peer: str, local: str | Region, remote: str | Region, descs: Any, *,
             notif: bytes | str | None = None, layer: Any = None, mode: str = "batch") -> Transfer:
        raise NotImplementedError

    def _new_region(self, name: str, buf: Any, kind: str) -> tuple[int, int]:
        """(address, bytes) of a buffer about to be registered as `name`, or TransportError."""
        if kind not in KINDS:
            raise TransportError(f"unknown region kind {kind!r}; expected one of {KINDS}")
        if name in self._regions:
            raise TransportError(f"region {name!r} already registered on agent {self.name!r}")
        addr, nbytes = _buffer_addr_len(buf)
        if nbytes == 0:
            raise TransportError(f"region {name!r} is empty")
        return addr, nbytes

    def _post_args(self, op: str, peer: str, local: str | Region, remote: str | Region,
                   notif: bytes | str | None, mode: str, modes: tuple[str, ...]) -> tuple[str, Region, Region, bytes | None]:
        """A post's arguments checked: (READ|WRITE, local region, remote region, notification)."""
        op = op.upper()
        if op not in ("READ", "WRITE"):
            raise TransportError(f"unknown op {op!r}; expected READ or WRITE")
        if mode not in modes:
            raise TransportError(f"unknown mode {mode!r}; expected {' or '.join(repr(m) for m in modes)}")
        lreg = local if isinstance(local, Region) else self._regions.get(local)
        if lreg is None:
            raise TransportError(f"agent {self.name!r} has no local region {local!r}")
        rreg = remote if isinstance(remote, Region) else self.remote_region(peer, remote)
        return op, lreg, rreg, notif.encode() if isinstance(notif, str) else notif

    def read(self, peer: str, local: str | Region, remote: str | Region, descs: Any, *,
             notif: bytes | str | None = None, layer: Any = None, mode: str = "batch",
             timeout: float | None = None) -> TransferStats:
        """READ remote -> local and wait (bounded by `timeout`)."""
        return self.post("READ", peer, local, remote, descs, notif=notif, layer=layer,
                         mode=mode).wait(timeout)

    def write(self, peer: str, local: str | Region, remote: str | Region, descs: Any, *,
              notif: bytes | str | None = None, layer: Any = None, mode: str = "batch",
              timeout: float | None = None) -> TransferStats:
        """WRITE local -> remote and wait (bounded by `timeout`)."""
        return self.post("WRITE", peer, local, remote, descs, notif=notif, layer=layer,
                         mode=mode).wait(timeout)


def check_descs(local: Region, remote: Region, descs: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(local offsets, remote offsets, lengths) of a (local_off, remote_off, length) list, each
    inside its region, or TransportError."""
    a = np.asarray(descs, dtype=np.int64)
    if a.ndim != 2 or a.shape[1] != 3 or a.shape[0] == 0:
        raise TransportError("descriptors must be a non-empty list of (local_off, remote_off, length)")
    loff, roff, ln = a[:, 0], a[:, 1], a[:, 2]
    if (ln <= 0).any() or (loff < 0).any() or (roff < 0).any():
        raise TransportError("descriptor offsets must be >= 0 and lengths > 0")
    if (loff + ln > local.nbytes).any():
        i = int(np.argmax(loff + ln > local.nbytes))
        raise TransportError(f"descriptor {i} runs past local region {local.name!r} "
                             f"({int(loff[i])}+{int(ln[i])} > {local.nbytes})")
    if (roff + ln > remote.nbytes).any():
        i = int(np.argmax(roff + ln > remote.nbytes))
        raise TransportError(f"descriptor {i} runs past remote region {remote.name!r} "
                             f"({int(roff[i])}+{int(ln[i])} > {remote.nbytes})")
    return loff, roff, ln


def contiguous_descs(total: int, ndesc: int, local_off: int = 0, remote_off: int = 0) -> np.ndarray:
    """Split [0, total) into `ndesc` nearly equal (local_off+x, remote_off+x, len) descriptors."""
    if ndesc <= 0 or total < ndesc:
        raise TransportError(f"cannot split {total} bytes into {ndesc} descriptors")
    bounds = np.linspace(0, total, ndesc + 1, dtype=np.int64)
    starts, lens = bounds[:-1], np.diff(bounds)
    return np.stack([starts + local_off, starts + remote_off, lens], axis=1)


def as_descs(items: Iterable[Sequence[int]]) -> np.ndarray:
    return np.asarray(list(items), dtype=np.int64).reshape(-1, 3)
