"""The KV transport over Mooncake's Transfer Engine (its TCP transport), behind Agent's interface.

`dualpath run --transport mooncake` gives every engine and host agent a `MooncakeAgent` instead of
a NIXL `Agent`; connectors, the host agents and every check see the same calls (register,
metadata/add_peer, post READ/WRITE of descriptor lists, notifications).

How it maps:
- Each descriptor of a list is a Mooncake batch of its own (`batch_transfer_async`), polled with
  `transfer_check_status` (1 done, negative failed, 0 pending; a finished batch is freed, so it is
  never asked again). The wheel's status call reads a batch's first task only (MooncakeTransfer).
- Peers find each other by P2P handshake (no metadata server): an agent's session is
  "ip:rpc_port" of its interface's address.
- A notification is a zero-length READ carrying a `TransferNotify`, sent once the transfer it
  follows has completed; the peer collects it with `get_notifies`. As with UCX over TCP, a
  WRITE's completion is seen when its bytes have left the sender, so the testbed's readers check
  the data itself (dualpath/kv/check.py) rather than trust the order.
- The class (TCP): Mooncake picks its RPC and data ports itself, at random inside
  MC_MIN_RPC_PORT..MC_MAX_RPC_PORT. Those are set to the kv port range (or the agent's sub-range),
  which nftables marks AF11, so every byte it moves is in the kv class. Mooncake refuses a range
  inside Linux's ephemeral ports and falls back to 15000-17000, unmarked: the kv range lies below
  them for that reason (traffic_classes.KV_PORT_RANGE). Only the kv class is offered.
- Over RDMA (`--transport mooncake-rdma`), its KV is RoCE with the kv DSCP (MC_IB_TC), and its
  RPC ports (handshakes, notifications) sit in RDMA_RPC_PORT_RANGE, outside the kv class.
- Mooncake reads its settings once per process: every agent of a process shares one port range.
"""
from __future__ import annotations

import fcntl
import os
import socket
import struct
import threading
import time
from typing import Any

import msgpack
import numpy as np

from dualpath.traffic_classes import KV, KV_PORT_RANGE, by_name

from .agent import _MD_VERSION, unpack_metadata
from .base import (
    DEFAULT_TIMEOUT_S,
    Region,
    Transfer,
    TransferFailed,
    TransportAgent,
    check_descs,
)
from .env import TransportError

WHEEL = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
TRANSPORT = "mooncake"
_SIOCGIFADDR = 0x8915
# Over RDMA its KV moves as RoCE (marked kv by MC_IB_TC) and its TCP carries only RPCs: their ports
# go below the ephemeral range but outside the kv range, so they count as control (model class),
# as the conductor's do. Measured in the VM with them in the kv range: 7-18 % of each NIC's
# kv-class packets were this TCP, and the counters' proof (RoCE share) failed though the KV was RoCE.
RDMA_RPC_PORT_RANGE = (23000, 23999)
_configured: dict[str, str] = {}  # the MC_* settings this process's engines were started with
_config_lock = threading.Lock()


class MissingMooncake(TransportError):
    """The Mooncake wheel is not installed."""


def need_mooncake() -> str:
    """The wheel's folder, or MissingMooncake naming what to install (one line)."""
    import importlib.util

    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise MissingMooncake(f"--transport mooncake needs Mooncake's transfer engine; fix: .venv/bin/pip install "
                              f"--no-deps {WHEEL} (scripts/bootstrap.sh installs it)")
    return next(iter(spec.submodule_search_locations))


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


def iface_ipv4(iface: str) -> str:
    """The IPv4 address of `iface` in this network namespace, or TransportError."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", iface.encode()[:15]))
        except OSError as e:
            raise TransportError(f"interface {iface!r} has no IPv4 address here ({e.strerror})") from None
    return socket.inet_ntoa(raw[20:24])


def configure(port_range: tuple[int, int] = KV_PORT_RANGE, rdma_device: str | None = None) -> None:
    """Mooncake's process-wide settings (its ports inside `port_range`, quiet logs; TCP only, or with
    `rdma_device` its RDMA transport on the device's IPv4 RoCEv2 GID with the kv class's DSCP in
    every packet). Call it before anything imports mooncake.engine or mooncake.store: they read
    them once, at import."""
    want = {"MC_MIN_RPC_PORT": str(port_range[0]), "MC_MAX_RPC_PORT": str(port_range[1]),
            "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "WARNING")}
    if rdma_device:
        from .rdma import ipv4_gid_index

        want.update(MC_GID_INDEX=str(ipv4_gid_index(rdma_device)), MC_IB_TC=str(KV.tos_byte))
    else:
        want["MC_FORCE_TCP"] = "1"
    with _config_lock:
        if _configured and _configured != want:
            raise TransportError(f"Mooncake reads its settings once per process: this one runs with "
                                 f"{_configured}, a second agent asked for {want}")
        os.environ.update(want)
        os.environ.setdefault("GLOG_minloglevel", "2")  # its handshakes log at INFO, its start at WARNING
        _configured.update(want)


class MooncakeTransfer(Transfer):
    """The descriptors of one post in flight, one Mooncake batch each.

    One batch per descriptor, because the wheel's `transfer_check_status` reports a batch's first
    task only, and frees the batch with it: a multi-descriptor batch reads as done while its later
    slices are still moving (seen here: the KV landed corrupt and the readers re-read it for 60 s).
    """

    def __init__(self, agent: "MooncakeAgent", op: str, peer: str, layer: Any, batches: list[int],
                 nbytes: int, t0: float, t_posted: float, notif: bytes | None):
        super().__init__(agent, op, peer, layer, batches, len(batches), nbytes, t0, t_posted, notif, notif_after=True)
        self._failed = ""

    def poll(self) -> bool:
        if self.done:
            return True
        if self._failed:
            raise TransferFailed(self._failed)
        check = self.agent._te.transfer_check_status
        still = []
        for i in self._pending:
            st = check(self.handles[i])  # nonzero: Mooncake freed the batch, it is never asked again
            if st < 0 and not self._failed:
                self._failed = f"{self._what()} failed in Mooncake's transfer engine (descriptor {i}, status {st})"
            elif st == 0:
                still.append(i)
        self._pending = still
        if self._failed:
            raise TransferFailed(self._failed)
        if still:
            return False
        t1 = time.perf_counter()
        if self._notif is not None:
            self.agent.send_notif(self.peer, self._notif)
        self._finish(t1)
        return True

    def _release(self) -> None:
        pass  # Mooncake has no way to abandon a batch; it ends with its own timeout


class MooncakeAgent(TransportAgent):
    """A Mooncake transfer engine bound to one interface, in the kv class.

    Args:
        name: unique agent name (peers address it by this name).
        iface: the interface whose address the engine serves on; peers reach it only there.
        traffic_class: "kv" (the only class whose ports Mooncake can be confined to).
        port_range: its RPC and data ports' range, inside the kv range (default: all of it).
        rdma_device: its RDMA transport on this rxe device (the one on `iface`) instead of TCP.
        timeout_s: default bound of every wait.
        poll_sleep_s: first sleep between completion polls (doubling up to 1 ms).
    """

    transport = TRANSPORT

    def __init__(self, name: str, iface: str, traffic_class: str = "kv", *,
                 port_range: tuple[int, int] | None = None, rdma_device: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, poll_sleep_s: float = 0.0001):
        need_mooncake()
        self.traffic_class = by_name(traffic_class)
        if self.traffic_class is not KV:
            raise TransportError(f"agent {name!r}: the Mooncake transport carries the kv class only "
                                 f"(its ports are confined to the kv range); got {traffic_class!r}")
        rng = port_range or (RDMA_RPC_PORT_RANGE if rdma_device else KV_PORT_RANGE)
        if rdma_device and _overlaps(rng, KV_PORT_RANGE):
            raise TransportError(f"agent {name!r}: over RDMA, Mooncake's TCP carries only its RPCs (handshakes, "
                                 f"notifications), which must stay out of the kv class; {rng[0]}-{rng[1]} overlaps "
                                 f"the kv range {KV_PORT_RANGE[0]}-{KV_PORT_RANGE[1]}")
        if not rdma_device and not (KV_PORT_RANGE[0] <= rng[0] <= rng[1] <= KV_PORT_RANGE[1]):
            raise TransportError(f"agent {name!r}: port range {rng[0]}-{rng[1]} is not inside the kv range "
                                 f"{KV_PORT_RANGE[0]}-{KV_PORT_RANGE[1]}: nftables would not mark it")
        self.name, self.iface = name, iface
        self.timeout_s, self.poll_sleep_s = timeout_s, poll_sleep_s
        self.ip = iface_ipv4(iface)
        configure(rng, rdma_device)
        from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

        self._Notify, self._Op = TransferNotify, TransferOpcode
        self.protocol = "rdma" if rdma_device else "tcp"
        self._te = TransferEngine()
        if self._te.initialize(self.ip, "P2PHANDSHAKE", self.protocol, rdma_device or "") != 0:
            raise TransportError(f"agent {name!r}: Mooncake's transfer engine did not start on {self.ip} ({iface})"
                                 + (f" with RDMA device {rdma_device}" if rdma_device else ""))
        port = self._te.get_rpc_port()
        if not rng[0] <= port <= rng[1]:  # its settings were read before ours were set
            raise TransportError(f"agent {name!r}: Mooncake listens on port {port}, outside {rng[0]}-{rng[1]}, so its "
                                 f"bytes would not be marked kv: mooncake.engine was imported before this agent set "
                                 f"its port range (create the first MooncakeAgent before importing it)")
        self.session = f"{self.ip}:{port}"
        self.transport_in_use = (f"mooncake/rdma via {rdma_device} ({iface})" if rdma_device
                                 else f"mooncake/tcp via {iface}")
        self.moved: dict[str, int] = {"READ": 0, "WRITE": 0}
        self._regions: dict[str, Region] = {}
        self._peers: dict[str, dict[str, Region]] = {}
        self._sessions: dict[str, str] = {}  # peer -> its "ip:rpc_port"
        self._notifs: dict[str, list[bytes]] = {}
        self._scratch = np.zeros(64, np.uint8)  # a notification's zero-length READ lands nowhere
        if self._te.register_memory(self._scratch.ctypes.data, self._scratch.nbytes) != 0:
            raise TransportError(f"agent {name!r}: Mooncake could not register memory")
        self._closed = False

    # ---- memory ---------------------------------------------------------------------------
    def register(self, name: str, buf: Any, kind: str = "dram") -> Region:
        addr, nbytes = self._new_region(name, buf, kind)
        if self._te.register_memory(addr, nbytes) != 0:
            raise TransportError(f"agent {self.name!r}: Mooncake could not register region {name!r}")
        reg = Region(name, kind, addr, nbytes, buf)
        self._regions[name] = reg
        return reg

    def deregister(self, name: str) -> None:
        self._te.unregister_memory(self._regions.pop(name).addr)

    # ---- metadata -------------------------------------------------------------------------
    def metadata(self) -> bytes:
        return msgpack.packb({
            "v": _MD_VERSION, "name": self.name, "transport": TRANSPORT, "protocol": self.protocol,
            "class": self.traffic_class.name,
            "session": self.session,
            "regions": {r.name: [r.kind, r.addr, r.nbytes] for r in self._regions.values()},
        }, use_bin_type=True)

    def add_peer(self, md: bytes) -> str:
        d = unpack_metadata(md, self.name)
        if d.get("transport") != TRANSPORT:
            raise TransportError(f"peer {d.get('name')!r} uses transport {d.get('transport')!r} but this agent "
                                 f"uses {TRANSPORT!r}: refusing to mix them")
        if d.get("protocol") != self.protocol:
            raise TransportError(f"peer {d.get('name')!r} runs Mooncake over {d.get('protocol')!r}, this agent over "
                                 f"{self.protocol!r}: refusing to mix them")
        self._peers[d["name"]] = {n: Region(n, k, a, s) for n, (k, a, s) in d["regions"].items()}
        self._sessions[d["name"]] = d["session"]
        return d["name"]

    def _session(self, peer: str) -> str:
        try:
            return self._sessions[peer]
        except KeyError:
            raise TransportError(f"agent {self.name!r}: unknown peer {peer!r} (add_peer first)") from None

    def _any_remote_addr(self, peer: str) -> int:
        """An address the peer registered (a zero-length READ must name one)."""
        self._session(peer)
        return next((r.addr for r in self._peers[peer].values()), 0)

    def connect(self, peer: str) -> None:
        """Handshake now rather than on the first transfer: a zero-length READ."""
        addr = self._any_remote_addr(peer)
        if self._te.transfer_sync(self._session(peer), self._scratch.ctypes.data, addr, 0, self._Op.Read) != 0:
            raise TransferFailed(f"agent {self.name!r}: Mooncake could not reach peer {peer!r} at {self._session(peer)}")

    # ---- transfers ------------------------------------------------------------------------
    def post(self, op: str, peer: str, local: str | Region, remote: str | Region, descs: Any, *,
             notif: bytes | str | None = None, layer: Any = None, mode: str = "batch") -> MooncakeTransfer:
        """Post a READ (remote -> local) or WRITE (local -> remote) of a descriptor list as one batch."""
        op, lreg, rreg, notif = self._post_args(op, peer, local, remote, notif, mode, ("batch",))
        t0 = time.perf_counter()
        loff, roff, ln = check_descs(lreg, rreg, descs)
        opcode = self._Op.Read if op == "READ" else self._Op.Write
        session = self._session(peer)
        batches = []
        for lo, ro, n in zip((lreg.addr + loff).tolist(), (rreg.addr + roff).tolist(), ln.tolist()):
            batch = self._te.batch_transfer_async(session, [lo], [ro], [n], opcode)
            if not batch:
                lay = f" layer {layer}" if layer is not None else ""
                raise TransferFailed(f"{op} with peer {peer!r}{lay}: Mooncake refused to submit it")
            batches.append(batch)
        return MooncakeTransfer(self, op, peer, layer, batches, int(ln.sum()), t0, time.perf_counter(), notif)

    # ---- notifications --------------------------------------------------------------------
    def send_notif(self, peer: str, msg: bytes | str) -> None:
        text = msg.decode() if isinstance(msg, bytes) else msg
        if self._te.transfer_sync(self._session(peer), self._scratch.ctypes.data, self._any_remote_addr(peer), 0, self._Op.Read,
                                  self._Notify(self.name, text)) != 0:
            raise TransferFailed(f"agent {self.name!r}: notification {text!r} to {peer!r} was not delivered")

    def _pull_notifs(self) -> None:
        for n in self._te.get_notifies():
            self._notifs.setdefault(n.name, []).append(n.msg.encode())

    # ---- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for reg in list(self._regions.values()):
            try:
                self._te.unregister_memory(reg.addr)
            except Exception:
                pass
        self._regions.clear()
        self._peers.clear()
        self._sessions.clear()

    def __repr__(self) -> str:
        return f"MooncakeAgent({self.name!r}, {self.session}, class={self.traffic_class.name})"
