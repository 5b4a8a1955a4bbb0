"""A narrow KV transport over NIXL/UCX: registered regions, one-sided READ/WRITE of
descriptor lists, completion with a bounded wait, and notifications.

One `Agent` per (process, interface, traffic class). The UCX environment is built and
checked (env.py) before the NIXL agent exists; UCX reads it when the agent's backend is
created, so several agents in one process may use different interfaces or classes.

The traffic class is a property of the agent, not of a transfer: over TCP neither NIXL nor UCX
can set IP TOS, so the class reaches the wire only through the agent's listening port range
(nftables marks the kv range AF11 by port). To choose the class per transfer, use
`MultiClassAgent` (multiclass.py): one Agent per class behind one name, with
`traffic_class=` on every read/write/post.

Descriptors are (local offset, remote offset, length) triples inside one local and one
remote registered region. A descriptor list is posted as ONE NIXL request
(`initialize_xfer` + `transfer`: the doorbell-batching analogue, one per layer); mode
"each" posts one request per descriptor, for measuring submission overhead.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import msgpack
import numpy as np

from dualpath.timeouts import scaled
from dualpath.traffic_classes import by_name

from .env import (
    TransportError,
    build_ucx_env,
    require_rdma,
)

DEFAULT_TIMEOUT_S = scaled(60.0)
KINDS = ("dram", "hbm")  # both are host memory on this machine; NIXL sees DRAM_SEG
_MD_VERSION = 1

_env_lock = threading.Lock()
_written_env: dict[str, str] = {}  # what we put in os.environ, so it is not mistaken for the user's


DEFAULT_PROGRESS_DELAY_US = 1000
MAX_POLL_SLEEP_S = 0.001  # a waiting transfer is polled at least this often


def _make_nixl_agent(name: str, progress_thread: bool, delay_us: int):
    """nixl_agent(name) with the UCX backend left to the caller and a non-spinning progress thread.

    nixl_agent.__init__ sets `pthrDelay = 0` on the binding's config, so we hand it a config
    subclass whose pthrDelay setter keeps our value instead (only while constructing).
    """
    nixl_agent, nixl_agent_config = _nixl()
    from nixl_cu12 import _api

    conf = nixl_agent_config(enable_prog_thread=progress_thread, backends=[])
    real = _api.nixlBind.nixlAgentConfig

    class _Config(real):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self):
            return real.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _value):
            real.pthrDelay.__set__(self, int(delay_us))

    _api.nixlBind.nixlAgentConfig = _Config
    try:
        return nixl_agent(name, conf)
    finally:
        _api.nixlBind.nixlAgentConfig = real


def unpack_metadata(md: bytes, who: str) -> dict:
    """A peer's metadata blob (an Agent's or a MultiClassAgent's), or TransportError."""
    try:
        d = msgpack.unpackb(md, raw=False)
        if d.get("v") != _MD_VERSION:
            raise ValueError(f"metadata version {d.get('v')!r}")
    except Exception as e:
        raise TransportError(f"agent {who!r}: peer metadata is not ours: {e}") from None
    return d


class TransferTimeout(TransportError):
    """A transfer did not complete in time."""


class TransferFailed(TransportError):
    """NIXL reported an error for a transfer."""


def _nixl():
    import logging

    from nixl_cu12._api import nixl_agent, nixl_agent_config  # lazy: the UCX env comes first

    if "NIXL_LOG_LEVEL" not in os.environ:  # its INFO lines go to stdout; keep stdout for results
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config


def _user_env() -> dict[str, str]:
    """os.environ minus the UCX values that earlier agents of this process wrote themselves."""
    env = dict(os.environ)
    for k, v in _written_env.items():
        if env.get(k) == v:
            del env[k]
    return env


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


class Agent(TransportAgent):
    """A NIXL agent bound to one interface and one traffic class.

    Args:
        name: unique agent name (peers address it by this name).
        iface: the network interface all its bytes must use (UCX_NET_DEVICES).
        traffic_class: "kv" or "model" (chooses the listening port range, hence the DSCP mark
            of every byte this agent moves; for a class per transfer see MultiClassAgent).
        transport: "tcp" or "rdma". "rdma" without an RDMA device on `iface`, or in a process
            without the system libibverbs preloaded, raises RdmaUnavailableError (rdma.py).
        port_range: listening sub-range inside the class range (default: the whole class range).
        tuning: extra UCX_* knobs (UCX_TCP_SNDBUF, ...); cannot override the mandatory ones.
        progress_thread: NIXL's progress thread. Needed by an agent that is the passive side
            of transfers (UCX over TCP serves a READ in software at the target) and does not
            poll. An agent that only initiates and waits should turn it off: two threads
            progressing one UCX worker contend for its spin lock (measured here: 3-5x the CPU
            per GB at a READ initiator, and slower).
        timeout_s: default bound of every wait.
        poll_sleep_s: sleep between completion polls (0 spins; spinning steals CPU from TCP).
        progress_delay_us: how long NIXL's progress thread waits for socket events before it
            polls again. The Python wrapper hard-codes 0, which busy-spins a whole core per agent
            even when idle: on a 2-core machine that starves the kernel's TCP stack.
    """

    def __init__(self, name: str, iface: str, traffic_class: str = "kv", transport: str = "tcp",
                 *, port_range: tuple[int, int] | None = None, tuning: dict[str, str] | None = None,
                 progress_thread: bool = True, num_workers: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, poll_sleep_s: float = 0.0001,
                 progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US, rdma_device: str | None = None):
        self.name = name
        self.iface = iface
        self.traffic_class = by_name(traffic_class)
        self.transport = transport
        self.timeout_s = timeout_s
        self.poll_sleep_s = poll_sleep_s
        dev = require_rdma(rdma_device, iface) if transport == "rdma" else None
        self.rdma_device = dev
        self.moved: dict[str, int] = {"READ": 0, "WRITE": 0}  # payload bytes of completed transfers
        with _env_lock:
            self.ucx_env = build_ucx_env(iface, self.traffic_class.name, transport,
                                         port_range=port_range, rdma_device=dev,
                                         base=_user_env(), tuning=tuning)
            if transport == "tcp":
                self.transport_in_use = f"ucx/tcp via {iface}"
            else:
                self.transport_in_use = f"ucx/rc_verbs via {dev} ({iface})"
            # UCX reads these when the backend's context is created, below.
            for k in list(_written_env):  # a previous agent's knobs must not leak into ours
                if k not in self.ucx_env and os.environ.get(k) == _written_env[k]:
                    del os.environ[k]
                    del _written_env[k]
            for k, v in self.ucx_env.items():
                os.environ[k] = v
                _written_env[k] = v
            init = {"ucx_devices": iface} if transport == "tcp" else {}
            self._nx = _make_nixl_agent(name, progress_thread, progress_delay_us)
            if "UCX" not in self._nx.get_plugin_list():
                raise TransportError("the NIXL UCX plugin is not available")
            if num_workers:
                init["num_workers"] = str(num_workers)
            self._nx.create_backend("UCX", init)
        self._regions: dict[str, Region] = {}
        self._reg_descs: dict[str, Any] = {}
        self._peers: dict[str, dict[str, Region]] = {}
        self._notifs: dict[str, list[bytes]] = {}
        self._closed = False

    # ---- memory ---------------------------------------------------------------------------
    def register(self, name: str, buf: Any, kind: str = "dram") -> Region:
        """Register a host buffer (numpy array or torch CPU tensor) under `name`.

        `kind` is "dram" (a DRAM buffer) or "hbm" (stands in for GPU memory; host memory here).
        Peers only see regions registered before they received `metadata()`.
        """
        addr, nbytes = self._new_region(name, buf, kind)
        descs = self._nx.get_reg_descs([(addr, nbytes, 0, name)], "DRAM")
        try:
            self._nx.register_memory(descs, backends=["UCX"])
        except Exception as e:
            if self.rdma_device is None:
                raise
            raise TransportError(
                f"agent {self.name!r}: registering region {name!r} ({nbytes / 2**20:.0f} MiB) with RDMA device "
                f"{self.rdma_device} failed ({type(e).__name__}): an RDMA device pins every registered byte "
                f"(ibv_reg_mr), so the buffer must fit in memory that can be locked") from None
        self._reg_descs[name] = descs
        reg = Region(name, kind, addr, nbytes, buf)
        self._regions[name] = reg
        return reg

    def deregister(self, name: str) -> None:
        self._nx.deregister_memory(self._reg_descs.pop(name), backends=["UCX"])
        del self._regions[name]

    # ---- metadata -------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """Bytes a peer passes to `add_peer`: NIXL metadata plus the region table."""
        return msgpack.packb({
            "v": _MD_VERSION,
            "name": self.name,
            "transport": self.transport,
            "class": self.traffic_class.name,
            "nixl": self._nx.get_agent_metadata(),
            "regions": {r.name: [r.kind, r.addr, r.nbytes] for r in self._regions.values()},
        }, use_bin_type=True)

    def add_peer(self, md: bytes) -> str:
        """Load a peer's `metadata()`; returns its name. Calling again refreshes its regions.

        A MultiClassAgent's metadata is accepted too: this agent keeps the part of its own
        class (the peer's agent in that class; for kv it has the peer's own name).
        """
        d = unpack_metadata(md, self.name)
        if "classes" in d:  # a MultiClassAgent: one agent per class
            part = d["classes"].get(self.traffic_class.name)
            if part is None:
                raise TransportError(
                    f"peer {d['name']!r} has no agent in traffic class {self.traffic_class.name!r} "
                    f"(has {sorted(d['classes'])}): their bytes would be marked differently")
            return self.add_peer(part)
        if d["transport"] != self.transport:
            raise TransportError(
                f"peer {d['name']!r} uses transport {d['transport']!r} but this agent uses "
                f"{self.transport!r}: refusing to mix them")
        if d["class"] != self.traffic_class.name:
            raise TransportError(
                f"peer {d['name']!r} is in traffic class {d['class']!r}, this agent in "
                f"{self.traffic_class.name!r}: their bytes would be marked differently")
        if d["name"] in self._peers:
            self._nx.remove_remote_agent(d["name"])
        peer = self._nx.add_remote_agent(d["nixl"])
        if isinstance(peer, bytes):
            peer = peer.decode()
        self._peers[peer] = {n: Region(n, k, a, s) for n, (k, a, s) in d["regions"].items()}
        return peer

    def connect(self, peer: str) -> None:
        """Open the connection now rather than on the first transfer (optional)."""
        self._nx.make_connection(peer)

    # ---- transfers ------------------------------------------------------------------------
    def _descs(self, local: Region, remote: Region, descs: Any) -> tuple[np.ndarray, np.ndarray, int]:
        loff, roff, ln = check_descs(local, remote, descs)
        n = len(ln)
        ld = np.zeros((n, 3), dtype=np.uint64)
        rd = np.zeros((n, 3), dtype=np.uint64)
        ld[:, 0] = local.addr + loff
        ld[:, 1] = ln
        rd[:, 0] = remote.addr + roff
        rd[:, 1] = ln
        return ld, rd, int(ln.sum())

    def post(self, op: str, peer: str, local: str | Region, remote: str | Region, descs: Any, *,
             notif: bytes | str | None = None, layer: Any = None, mode: str = "batch") -> Transfer:
        """Post a one-sided READ (remote -> local) or WRITE (local -> remote).

        mode "batch": the whole list is ONE NIXL request (one initialize_xfer + transfer).
        mode "each": one request per descriptor (for the submission-overhead benchmark).
        `notif` reaches the peer (see `get_notifs`/`wait_notif`) once the data has landed.
        """
        op, lreg, rreg, notif = self._post_args(op, peer, local, remote, notif, mode, ("batch", "each"))
        t0 = time.perf_counter()
        ld, rd, nbytes = self._descs(lreg, rreg, descs)
        nx = self._nx
        handles = []
        try:
            if mode == "batch":
                h = nx.initialize_xfer(op, nx.get_xfer_descs(ld, "DRAM"), nx.get_xfer_descs(rd, "DRAM"),
                                       peer, notif or b"")
                handles.append(h)
                self._post_one(h, notif or b"", op, peer, layer)
            else:
                for i in range(ld.shape[0]):
                    h = nx.initialize_xfer(op, nx.get_xfer_descs(ld[i:i + 1], "DRAM"),
                                           nx.get_xfer_descs(rd[i:i + 1], "DRAM"), peer)
                    handles.append(h)
                    self._post_one(h, b"", op, peer, layer)
        except Exception:
            for h in handles:
                try:
                    h.release()
                except Exception:
                    pass
            raise
        t_posted = time.perf_counter()
        return Transfer(self, op, peer, layer, handles, ld.shape[0], nbytes, t0, t_posted,
                        notif, notif_after=(mode == "each"))

    def _post_one(self, h, notif: bytes, op: str, peer: str, layer: Any) -> None:
        st = self._nx.transfer(h, notif)
        if st == "ERR":
            lay = f" layer {layer}" if layer is not None else ""
            raise TransferFailed(f"{op} with peer {peer!r}{lay}: posting failed in NIXL/UCX")

    # ---- notifications --------------------------------------------------------------------
    def send_notif(self, peer: str, msg: bytes | str) -> None:
        self._nx.send_notif(peer, msg.encode() if isinstance(msg, str) else msg)

    def _pull_notifs(self) -> None:
        for peer, msgs in self._nx.get_new_notifs().items():
            if isinstance(peer, bytes):
                peer = peer.decode()
            self._notifs.setdefault(peer, []).extend(msgs)

    # ---- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for peer in list(self._peers):
            try:
                self._nx.remove_remote_agent(peer)
            except Exception:
                pass
        for name in list(self._reg_descs):
            try:
                self._nx.deregister_memory(self._reg_descs.pop(name), backends=["UCX"])
            except Exception:
                pass
        self._regions.clear()
        self._peers.clear()

    def __repr__(self) -> str:
        return (f"Agent({self.name!r}, {self.transport_in_use}, class={self.traffic_class.name}, "
                f"ports={self.ucx_env.get('UCX_TCP_PORT_RANGE')})")


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
