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
from typing import Any

import msgpack
import numpy as np

from dualpath.traffic_classes import by_name
from .env import TransportError, build_ucx_env, require_rdma
from dualpath.transport.base import DEFAULT_TIMEOUT_S, Region, Transfer, TransferFailed, TransportAgent, check_descs


_MD_VERSION = 1


_env_lock = threading.Lock()


_written_env: dict[str, str] = {}  # what we put in os.environ, so it is not mistaken for the user's


DEFAULT_PROGRESS_DELAY_US = 1000


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
