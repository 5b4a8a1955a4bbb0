"""Per-transfer traffic classes: one NIXL agent per class, behind one name.

Why not a traffic class per transfer on one agent: on the TCP transport neither NIXL nor UCX
can set IP TOS, per transfer or at all. The only handle the testbed has on the DSCP of UCX's
bytes is the port: an agent's UCX context listens in `UCX_TCP_PORT_RANGE`, read from the
environment when the context is created, and nftables in every namespace marks the kv port
range (22000-22999) AF11 in both directions; everything else on a CNIC is the model class
(HTB's default class). A UCX context, hence a NIXL agent, therefore carries exactly one class.

`MultiClassAgent` owns one `Agent` per traffic class it carries, all on the same interface.
Every region is registered with each of them, `metadata()` is one blob holding every class
agent's metadata, and `post`/`read`/`write` take `traffic_class=` (default "kv") and run on
that class's pair of agents, so the bytes travel on connections whose ports get the class's
DSCP mark. Notifications from all of a peer's class agents are merged under the peer's name.

Names: the kv agent keeps the endpoint's own name, other classes are `<name>@<class>`. A plain
kv `Agent` can therefore talk to a MultiClassAgent (and be talked to) exactly as before:
`Agent.add_peer` takes the combined blob and keeps its own class's part, and
`MultiClassAgent.add_peer` takes a plain agent's metadata for that agent's class only.

Cost: each class agent is a UCX context with its own listening socket. An initiator that polls
its own transfers runs no progress threads at all (`progress_thread=False`); a passive side
runs one per class, each waiting `progress_delay_us` for socket events, so an idle class agent
sleeps rather than spins. Build only the classes you use (`classes=`).

Ephemeral ports: a model-class connection whose kernel-chosen source port falls in the kv
range would be marked AF11 (seen on loopback: a model connection from port 42785). The fabric
reserves that range in every namespace (net.ipv4.ip_local_reserved_ports); a MultiClassAgent
on TCP that carries a class other than kv refuses to start where it is not reserved, unless
`require_reserved_ports=False` (then that class's marking is only probably right).
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

import msgpack

from dualpath.traffic_classes import CLASSES, KV, KV_PORT_RANGE, by_name

from .agent import _MD_VERSION, DEFAULT_PROGRESS_DELAY_US, Agent, _user_env, unpack_metadata
from .base import DEFAULT_TIMEOUT_S, NotificationInbox, Region, Transfer, TransferStats
from .env import TransportError, UcxEnvError

DEFAULT_CLASS = KV.name
_RESERVED_PORTS = "/proc/sys/net/ipv4/ip_local_reserved_ports"
_LOCAL_PORT_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def class_agent_name(name: str, traffic_class: str) -> str:
    """The NIXL agent name of `name`'s agent in `traffic_class` (kv keeps the bare name)."""
    tc = by_name(traffic_class)
    return name if tc is KV else f"{name}@{tc.name}"


def kv_ports_reserved(path: str = _RESERVED_PORTS, local_range_path: str = _LOCAL_PORT_RANGE) -> bool:
    """True when this network namespace never hands out kv-range ports as ephemeral ports: the
    range lies outside ip_local_port_range (the default since the kv range moved below it), or
    ip_local_reserved_ports covers it."""
    lo, hi = KV_PORT_RANGE
    try:
        first, last = (int(x) for x in open(local_range_path).read().split())
        if hi < first or lo > last:
            return True
    except (OSError, ValueError):
        pass
    try:
        text = open(path).read().strip()
    except OSError:
        return False
    covered: list[tuple[int, int]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        a, _, b = part.partition("-")
        covered.append((int(a), int(b or a)))
    covered.sort()
    nxt = lo
    for a, b in covered:
        if a > nxt:
            break
        nxt = max(nxt, b + 1)
    return nxt > hi


def _per_class(value: Any, cls: str, default: Any) -> Any:
    if isinstance(value, Mapping):
        return value.get(cls, default)
    return default if value is None else value


class MultiClassAgent(NotificationInbox):
    """One endpoint, one NIXL agent per traffic class; the class is chosen per transfer.

    Args:
        name: endpoint name (peers address it by this name; the kv agent's NIXL name).
        iface: the interface all its bytes must use (UCX_NET_DEVICES), for every class.
        transport: "tcp" or "rdma" (on rdma each class agent sets UCX_IB_TRAFFIC_CLASS).
        classes: traffic classes to carry (default all: model and kv).
        port_ranges: {class: (lo, hi)} listening sub-range per class (default: the class range).
        progress_thread, progress_delay_us: as for `Agent`, one value for every class or a
            {class: value} mapping.
        tuning, num_workers, timeout_s, poll_sleep_s, rdma_device: as for `Agent`.
        require_reserved_ports: on TCP with a class other than kv, refuse to start unless this
            namespace reserves the kv port range from ephemeral ports (see module docstring).
    """

    def __init__(self, name: str, iface: str, transport: str = "tcp", *,
                 classes: Iterable[str] | None = None,
                 port_ranges: Mapping[str, tuple[int, int]] | None = None,
                 tuning: dict[str, str] | None = None,
                 progress_thread: bool | Mapping[str, bool] = True,
                 num_workers: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 poll_sleep_s: float = 0.0001,
                 progress_delay_us: int | Mapping[str, int] = DEFAULT_PROGRESS_DELAY_US,
                 rdma_device: str | None = None, require_reserved_ports: bool = True):
        names = [c.name for c in CLASSES] if classes is None else [by_name(c).name for c in classes]
        if not names or len(set(names)) != len(names):
            raise TransportError(f"classes must be distinct traffic classes, got {names}")
        for c in port_ranges or {}:
            if by_name(c).name not in names:
                raise TransportError(f"port range given for class {c!r}, which is not carried")
        if transport == "tcp" and len(names) > 1 and "UCX_TCP_PORT_RANGE" in _user_env():
            raise UcxEnvError(
                f"process environment: UCX_TCP_PORT_RANGE={os.environ['UCX_TCP_PORT_RANGE']} "
                f"but a multi-class agent listens in one port range per class ({', '.join(names)}): "
                f"unset it and pass port_ranges instead")
        if (transport == "tcp" and require_reserved_ports and set(names) - {KV.name}
                and not kv_ports_reserved()):
            lo, hi = KV_PORT_RANGE
            raise UcxEnvError(
                f"agent {name!r}: this network namespace may hand out ports {lo}-{hi} as "
                f"ephemeral source ports, so a {'/'.join(sorted(set(names) - {KV.name}))}-class "
                f"connection could be marked AF11 by port; run "
                f"`sysctl -w net.ipv4.ip_local_reserved_ports={lo}-{hi}` in it (the fabric does), "
                f"or pass require_reserved_ports=False")
        self.name = name
        self.iface = iface
        self.transport = transport
        self.timeout_s = timeout_s
        self.poll_sleep_s = poll_sleep_s
        self._agents: dict[str, Agent] = {}
        try:
            for c in names:
                self._agents[c] = Agent(
                    class_agent_name(name, c), iface, c, transport,
                    port_range=(port_ranges or {}).get(c), tuning=tuning,
                    progress_thread=_per_class(progress_thread, c, True),
                    num_workers=num_workers, timeout_s=timeout_s, poll_sleep_s=poll_sleep_s,
                    progress_delay_us=_per_class(progress_delay_us, c, DEFAULT_PROGRESS_DELAY_US),
                    rdma_device=rdma_device)
        except BaseException:
            for a in self._agents.values():
                a.close()
            raise
        self.classes: tuple[str, ...] = tuple(names)
        self._where = f" in any of {list(self.classes)}"
        # peer name -> {class: that class agent's NIXL name}; and back, for notifications
        self._peers: dict[str, dict[str, str]] = {}
        self._base: dict[str, str] = {}
        self._notifs: dict[str, list[bytes]] = {}
        self._closed = False

    # ---- the class agents -----------------------------------------------------------------
    def agent(self, traffic_class: str = DEFAULT_CLASS) -> Agent:
        """The agent that carries `traffic_class`."""
        try:
            c = by_name(traffic_class).name
        except ValueError as e:
            raise TransportError(f"agent {self.name!r}: {e}") from None
        try:
            return self._agents[c]
        except KeyError:
            raise TransportError(f"agent {self.name!r} does not carry traffic class {c!r} "
                                 f"(carries {list(self.classes)})") from None

    @property
    def transport_in_use(self) -> str:
        return next(iter(self._agents.values())).transport_in_use

    @property
    def ucx_env(self) -> dict[str, dict[str, str]]:
        return {c: a.ucx_env for c, a in self._agents.items()}

    # ---- memory ---------------------------------------------------------------------------
    def register(self, name: str, buf: Any, kind: str = "dram") -> Region:
        """Register a host buffer with every class agent (see `Agent.register`)."""
        done: list[Agent] = []
        try:
            for a in self._agents.values():
                reg = a.register(name, buf, kind)
                done.append(a)
        except BaseException:
            for a in done:
                a.deregister(name)
            raise
        return reg

    def deregister(self, name: str) -> None:
        for a in self._agents.values():
            a.deregister(name)

    def region(self, name: str) -> Region:
        return next(iter(self._agents.values())).region(name)

    # ---- metadata -------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """One blob for `add_peer` (of a MultiClassAgent or a plain Agent): every class agent's."""
        return msgpack.packb({
            "v": _MD_VERSION,
            "name": self.name,
            "transport": self.transport,
            "classes": {c: a.metadata() for c, a in self._agents.items()},
        }, use_bin_type=True)

    def add_peer(self, md: bytes) -> str:
        """Load a peer's metadata: a MultiClassAgent's (each class we share) or a plain Agent's
        (its class only). Returns the peer's name. Calling again refreshes its regions."""
        d = unpack_metadata(md, self.name)
        if "classes" in d:
            base, blobs = d["name"], d["classes"]
        else:  # a plain Agent: one class, addressed by its own name
            base, blobs = d["name"], {d["class"]: md}
        shared = [c for c in self.classes if c in blobs]
        if not shared:
            raise TransportError(
                f"peer {base!r} carries traffic classes {sorted(blobs)}, agent {self.name!r} "
                f"carries {list(self.classes)}: no class in common")
        names = {c: self._agents[c].add_peer(blobs[c]) for c in shared}
        old = self._peers.get(base, {})
        for c, n in old.items():
            if c not in names:  # the peer no longer offers this class
                self._base.pop(n, None)
        self._peers[base] = names
        for n in names.values():
            self._base[n] = base
        return base

    def peers(self) -> list[str]:
        return list(self._peers)

    def peer_classes(self, peer: str) -> tuple[str, ...]:
        """The traffic classes this agent can use towards `peer`."""
        return tuple(self._peer_map(peer))

    def _peer_map(self, peer: str) -> dict[str, str]:
        try:
            return self._peers[peer]
        except KeyError:
            raise TransportError(f"agent {self.name!r}: unknown peer {peer!r} (add_peer first)") from None

    def _route(self, peer: str, traffic_class: str) -> tuple[Agent, str]:
        """(our agent, the peer's agent name) that carry `traffic_class` towards `peer`."""
        a = self.agent(traffic_class)
        c = a.traffic_class.name
        names = self._peer_map(peer)
        if c not in names:
            raise TransportError(
                f"peer {peer!r} has no agent in traffic class {c!r} (has {sorted(names)}): "
                f"its bytes could not be marked {c}")
        return a, names[c]

    def remote_region(self, peer: str, name: str, traffic_class: str = DEFAULT_CLASS) -> Region:
        a, p = self._route(peer, traffic_class)
        return a.remote_region(p, name)

    def connect(self, peer: str, traffic_class: str | None = None) -> None:
        """Open the connection(s) now: one class, or every class shared with `peer`."""
        for c in ([traffic_class] if traffic_class else self.peer_classes(peer)):
            a, p = self._route(peer, c)
            a.connect(p)

    # ---- transfers ------------------------------------------------------------------------
    def post(self, op: str, peer: str, local: str | Region, remote: str | Region, descs: Any, *,
             traffic_class: str = DEFAULT_CLASS, notif: bytes | str | None = None,
             layer: Any = None, mode: str = "batch") -> Transfer:
        """`Agent.post` on the agents of `traffic_class`: its bytes get that class's mark."""
        a, p = self._route(peer, traffic_class)
        return a.post(op, p, local, remote, descs, notif=notif, layer=layer, mode=mode)

    def read(self, peer: str, local: str | Region, remote: str | Region, descs: Any, *,
             traffic_class: str = DEFAULT_CLASS, notif: bytes | str | None = None,
             layer: Any = None, mode: str = "batch", timeout: float | None = None) -> TransferStats:
        """READ remote -> local in `traffic_class` and wait (bounded by `timeout`)."""
        return self.post("READ", peer, local, remote, descs, traffic_class=traffic_class,
                         notif=notif, layer=layer, mode=mode).wait(timeout)

    def write(self, peer: str, local: str | Region, remote: str | Region, descs: Any, *,
              traffic_class: str = DEFAULT_CLASS, notif: bytes | str | None = None,
              layer: Any = None, mode: str = "batch", timeout: float | None = None) -> TransferStats:
        """WRITE local -> remote in `traffic_class` and wait (bounded by `timeout`)."""
        return self.post("WRITE", peer, local, remote, descs, traffic_class=traffic_class,
                         notif=notif, layer=layer, mode=mode).wait(timeout)

    # ---- notifications --------------------------------------------------------------------
    def send_notif(self, peer: str, msg: bytes | str, traffic_class: str = DEFAULT_CLASS) -> None:
        a, p = self._route(peer, traffic_class)
        a.send_notif(p, msg)

    def _pull_notifs(self) -> None:
        # Each class agent has its own UCX worker and inbox; a transfer's notification arrives
        # at the agent of its class. Merge them under the sender's endpoint name. Order is kept
        # within a class, not across classes (they are separate connections).
        for a in self._agents.values():
            for sender, msgs in a.get_notifs().items():
                self._notifs.setdefault(self._base.get(sender, sender), []).extend(msgs)

    # ---- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for a in self._agents.values():
            a.close()
        self._peers.clear()
        self._base.clear()

    def __repr__(self) -> str:
        ports = {c: a.ucx_env.get("UCX_TCP_PORT_RANGE") for c, a in self._agents.items()}
        return f"MultiClassAgent({self.name!r}, {self.transport_in_use}, ports={ports})"
