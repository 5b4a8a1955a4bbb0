"""The emulated cluster fabric: Mininet hosts, two bridges, shaped NICs, DSCP marks.

Build is declarative (`ClusterTopo`, a Mininet Topo), then `Fabric.up()`
instantiates it. Each node is a host namespace (DRAM buffer side: host port on
the compute bridge, SNIC on the storage bridge) plus one namespace per engine
whose only interface is its CNIC. Storage servers sit on the storage bridge.

Every Mininet host's namespace is also attached under a name (`ip netns
attach`) so that standard tools and `dualpath clean` can see it.

With transport "rdma" (Soft-RoCE, a kernel with rdma_rxe: the VM of scripts/vm.sh), every
engine namespace gets an rxe device on its CNIC and every node's host namespace one on its
host port, each named after its namespace (`<ns>-rxe`, e.g. dpt-p0e0-rxe: UCX truncates device
names to 15 characters and then silently uses TCP, see dualpath/transport/rdma.py). RoCEv2 is UDP 4791: its packets carry the
traffic class UCX sets (UCX_IB_TRAFFIC_CLASS, DSCP << 2) in the IPv4 TOS byte, so the same u32
filters put them in the same HTB classes. Storage traffic stays on TCP (the store's protocol).

With `hosts: docker` every namespace is a Docker container's instead (testbed/fabric/containers.py):
the container starts with no network, and its Mininet host is a shell attached to it
(`ContainerHost`), so Mininet moves the veths into the container's namespace as it would into
its own host's, and the shaping, marks and counters below apply unchanged. Node processes
enter the container (`Fabric.exec_argv`).
"""
from __future__ import annotations

import ipaddress
import signal
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from mininet.link import Link
from mininet.net import Mininet
from mininet.node import Host
from mininet.nodelib import LinuxBridge
from mininet.topo import Topo

from dualpath.naming import PREFIX
from dualpath.traffic_classes import KV_PORT_RANGE
from emulators import dscp_marking
from emulators.nic import NicShape, htb_batch, unshape_batch
from testbed.fabric.cleanup import find_leftovers, kill_processes_in
from testbed.fabric.shell import ns_argv, run
from testbed.placement import placement, server_of_namespace, servers, spans_servers
from testbed.topology_servers import ServerSpec
from testbed.topology import Topology

COMPUTE_BRIDGE = f"{PREFIX}-cbr"
STORAGE_BRIDGE = f"{PREFIX}-sbr"
COMPUTE_NET = ipaddress.ip_network("10.77.0.0/16")
STORAGE_NET = ipaddress.ip_network("10.78.0.0/16")
# Tail loss probes off in every namespace of the fabric. A TLP fires when an ACK is later than
# twice the smoothed RTT, and an HTB queue of a shaped NIC delays ACKs by far more than the
# RTT of an empty one. scripts/tcp_counters.py (tests/test_e2e.py's workload, every mode): with
# probes on, the PE and DE hosts re-sent 158 and 174 segments, every one a probe answered by a
# DSACK (it had arrived), with no qdisc drop anywhere; off, 0 and 1. HTB counts a re-sent byte
# twice, and under load that pushed NICs past their path definitions. RDMA, which TCP stands in
# for here, has no such probes; a real loss is still recovered by fast retransmit or the RTO.
TCP_SYSCTLS = ("net.ipv4.tcp_early_retrans=0",)
CONDUCTOR_IP = str(COMPUTE_NET[-2])  # on the compute bridge, in the root namespace
STORAGE_CLIENT_IP = str(STORAGE_NET[-2])  # on the storage bridge, in the root namespace (`dualpath up`)
# The root namespace does not reserve the kv port range (it is the user's): nftables leaves its
# packets unmarked whatever their ports (emulators/dscp_marking.py).
ROOT_IPS = (CONDUCTOR_IP, STORAGE_CLIENT_IP)


class FabricBusy(RuntimeError):
    """The testbed's names are taken: another testbed is up (or a dead one left them)."""


@dataclass(frozen=True)
class Nic:
    """One emulated NIC: a veth whose namespace end is `dev` and bridge end `bridge_dev`."""

    kind: str  # "cnic", "host_port", "snic", "storage_nic"
    ns: str
    dev: str
    bridge_dev: str
    ip: str
    rate_bps: int
    classes: bool  # two QoS classes on this NIC


@dataclass(frozen=True)
class Endpoint:
    """A namespace of the testbed: a node's host side, an engine, or a storage server."""

    name: str  # also the namespace name
    role: str  # "prefill", "decode", "storage"
    kind: str  # "host", "engine", "storage"
    node: str  # owning node name (itself for host and storage)
    nics: tuple[Nic, ...] = field(default=())

    def nic(self, kind: str) -> Nic:
        return next(n for n in self.nics if n.kind == kind)

    @property
    def ip(self) -> str:
        return self.nics[0].ip


def plan(topo: Topology) -> list[Endpoint]:
    """Every namespace and NIC of a topology, with names, addresses and rates."""
    s = topo.spec
    qos = s.qos
    eps: list[Endpoint] = []
    cidx = sidx = 0

    def cip() -> str:
        nonlocal cidx
        cidx += 1
        return f"{COMPUTE_NET[cidx]}"

    def sip() -> str:
        nonlocal sidx
        sidx += 1
        return f"{STORAGE_NET[sidx]}"

    for role, letter, count in (("prefill", "p", s.prefill_nodes), ("decode", "d", s.decode_nodes)):
        for i in range(count):
            node = f"{PREFIX}-{letter}{i}"
            short = f"{letter}{i}"
            eps.append(Endpoint(node, role, "host", node, (
                Nic("host_port", node, f"{node}-hp", f"{COMPUTE_BRIDGE}-{short}", cip(),
                    topo.host_port_bps, False),
                Nic("snic", node, f"{node}-snic", f"{STORAGE_BRIDGE}-{short}", sip(),
                    topo.snic_bps, False),
            )))
            for e in range(s.engines_per_node):
                eng = f"{node}e{e}"
                eps.append(Endpoint(eng, role, "engine", node, (
                    Nic("cnic", eng, f"{eng}-cnic", f"{COMPUTE_BRIDGE}-{short}e{e}", cip(),
                        topo.cnic_bps, qos),
                )))
    for i in range(s.storage.servers):
        name = f"{PREFIX}-s{i}"
        eps.append(Endpoint(name, "storage", "storage", name, (
            Nic("storage_nic", name, f"{name}-nic", f"{STORAGE_BRIDGE}-s{i}", sip(),
                topo.storage_nic_bps, False),
        )))
    return eps


def engine_groups(endpoints: list[Endpoint]) -> dict[str, list[Endpoint]]:
    """Group id -> its engines, leader first: the prefill engines form one group (one
    data-parallel attention group, also the target's expert-parallel group); each decode node's
    engines form another. The scheduler's groups and the collectives' groups are these."""
    out: dict[str, list[Endpoint]] = {"pe": [e for e in endpoints if e.kind == "engine" and e.role == "prefill"]}
    for e in endpoints:
        if e.kind == "engine" and e.role == "decode":
            out.setdefault(f"de-{e.node}", []).append(e)
    return out


class ContainerHost(Host):
    """A Mininet host whose shell is attached to a running container's network and mount
    namespaces (mnexec -a) instead of new ones: Mininet then wires the container as its own."""

    def __init__(self, name: str, container_pid: int, **params: object):
        self.container_pid = container_pid
        super().__init__(name, **params)

    def _popen(self, cmd: list[str], **params: object):  # type: ignore[override]
        if not self.shell and cmd[:1] == ["mnexec"]:  # the shell itself: -cdn becomes -cd -a PID
            cmd = ["mnexec", cmd[1].replace("n", ""), "-a", str(self.container_pid), *cmd[2:]]
        return super()._popen(cmd, **params)


class ClusterTopo(Topo):
    """The declarative Mininet topology: hosts, two bridges, one veth per NIC."""

    def build(self, endpoints: list[Endpoint],  # type: ignore[override]
              container_pids: dict[str, int] | None = None) -> None:
        self.addSwitch(COMPUTE_BRIDGE, cls=LinuxBridge, dpid="1")
        self.addSwitch(STORAGE_BRIDGE, cls=LinuxBridge, dpid="2")
        for ep in endpoints:
            if container_pids:
                self.addHost(ep.name, ip=None, cls=ContainerHost, container_pid=container_pids[ep.name])
            else:
                self.addHost(ep.name, ip=None)
            for nic in ep.nics:
                bridge = COMPUTE_BRIDGE if nic.bridge_dev.startswith(COMPUTE_BRIDGE) else STORAGE_BRIDGE
                prefix = COMPUTE_NET if bridge == COMPUTE_BRIDGE else STORAGE_NET
                self.addLink(ep.name, bridge, intfName1=nic.dev, intfName2=nic.bridge_dev,
                             params1={"ip": f"{nic.ip}/{prefix.prefixlen}"})


class Fabric:
    """A live emulated cluster. Use as a context manager so teardown always runs."""

    def __init__(self, topo: Topology, transport: str = "tcp", shares: Sequence[Path] = (),
                 server: str | None = None):
        """`shares`: folders the node processes read and write (the run's scratch folder, the
        checkpoint's), bind-mounted into every container with `hosts: docker` (the checkout and
        its venv are in the node image, testbed/fabric/node_image.py). `server`: with a topology
        over several servers, the one whose part this fabric is (default: the first, which also
        brings up the others' parts over SSH and joins their bridges: testbed/fabric/remote.py)."""
        if transport not in ("tcp", "rdma"):
            raise ValueError(f"unknown transport {transport!r}; expected tcp or rdma")
        first = servers(topo)[0].name
        self.server = server or first
        if self.server not in {v.name for v in servers(topo)}:
            raise ValueError(f"topology {topo.name} has no server {self.server!r}")
        # The first server's fabric leads: it brings up the other servers' parts.
        self.remotes = ([v for v in servers(topo)[1:] if v.name in set(placement(topo).values())]
                        if self.server == first else [])
        if transport == "rdma" and spans_servers(topo):
            raise ValueError("transport rdma across servers is not supported: the tunnels carry TCP")
        self.topo = topo
        self.shares = tuple(Path(p) for p in shares)
        self.containers: dict[str, int] = {}  # namespace -> its container's init pid (hosts: docker)
        self.timings: dict[str, float] = {}  # bring-up and teardown phases, seconds
        self.transport = transport
        self.rxe: dict[str, str] = {}  # veth (namespace end) -> its rxe device, with transport rdma
        # The leader's endpoints are the whole cluster (its processes, counters and accounting);
        # what this fabric builds itself is the part placed on its own server.
        whole = plan(topo)
        # which server holds each namespace, once: counters and process starts ask per NIC and process
        self._server_by_ns = {ep.name: server_of_namespace(topo, ep.name) for ep in whole}
        self.local_endpoints = [ep for ep in whole if self._server_by_ns[ep.name] == self.server]
        self.endpoints = whole if self.server == first else self.local_endpoints
        self.tunnels_up: list[str] = []  # tunnel devices made on this server
        self._remote_up = False  # the other servers' parts were asked up: down() asks them down
        self.net: Mininet | None = None
        self._attached: list[str] = []
        self._shaped = False
        self.qos = topo.spec.qos

    # -- lookup -------------------------------------------------------------
    def endpoint(self, name: str) -> Endpoint:
        full = name if name.startswith(PREFIX) else f"{PREFIX}-{name}"
        for ep in self.endpoints:
            if ep.name == full:
                return ep
        raise KeyError(f"no endpoint {name!r} in topology {self.topo.name}")

    @property
    def is_remote_part(self) -> bool:
        """This fabric is a server's part of a topology over several, not the first server's
        (which leads, and holds the root namespace's addresses)."""
        return self.server != servers(self.topo)[0].name

    @property
    def nics(self) -> list[Nic]:
        return [n for ep in self.endpoints for n in ep.nics]

    @property
    def local_nics(self) -> list[Nic]:
        return [n for ep in self.local_endpoints for n in ep.nics]

    def run_in(self, ns: str, argv: Sequence[str], root: bool = False) -> str:
        """Run a command to completion in namespace `ns` (root: in the root namespace of the
        server that holds `ns`, where its NICs' bridge ends are), here or over SSH; its stdout."""
        server = self.server_of(ns)
        if server is None:
            return run(argv, ns=None if root else ns)
        from testbed.fabric.remote import run_checked

        return run_checked(server, list(argv) if root else ["ip", "netns", "exec", ns, *argv])

    def server_of(self, ns: str) -> ServerSpec | None:
        """The remote server that holds namespace `ns` (None: this machine)."""
        name = self._server_by_ns.get(ns, self.server)
        return next((v for v in self.remotes if v.name == name), None) if name != self.server else None

    @property
    def docker(self) -> bool:
        return self.topo.spec.hosts == "docker"

    def exec_argv(self, ns: str, argv: Sequence[str], env: dict[str, str] | None = None) -> list[str]:
        """argv prefixed to run as a process of namespace `ns`: in it, in its container, or on
        the server that holds it (over SSH, with `env` set there and this machine's python
        replaced by that server's; the caller's own env applies here only)."""
        server = self.server_of(ns)
        if server is not None:
            from testbed.fabric.remote import remote_argv

            return remote_argv(server, ns, list(argv), env or {})
        if ns in self.containers:
            from testbed.fabric.containers import enter_argv

            return enter_argv(self.containers[ns], list(argv))
        return ns_argv(ns, argv)

    # -- lifecycle ------------------------------------------------------------
    def _start_containers(self) -> None:
        from testbed.fabric import containers
        from testbed.fabric import node_image

        t0 = time.monotonic()
        containers.start_daemon()
        image = node_image.ensure()  # carries the checkout and the venv (vfs: binds them instead)
        shares = [(p, False) for p in image.binds]
        for p in self.shares:
            p.mkdir(parents=True, exist_ok=True)
            shares.append((p.resolve(), True))
        limits = self.topo.spec.container_limits

        def start(ep: Endpoint) -> tuple[str, int]:
            lim = containers.Limits.of(getattr(limits, ep.kind) if limits else None)
            return ep.name, containers.run_container(ep.name, image.ref, shares, lim)

        # A few at a time: the daemon overlaps them (with vfs, each copies the image)
        with ThreadPoolExecutor(max_workers=4) as pool:
            self.containers.update(pool.map(start, self.local_endpoints))
        containers.weigh_containers(len(self.local_endpoints))
        self.timings["containers_s"] = time.monotonic() - t0

    def up(self) -> "Fabric":
        t0 = time.monotonic()
        self._refuse_if_taken()
        if self.docker:
            self._start_containers()
        self.net = Mininet(topo=ClusterTopo(endpoints=self.local_endpoints, container_pids=self.containers or None),
                           switch=LinuxBridge,
                           host=Host, link=Link, controller=None, build=False,
                           autoSetMacs=False, autoStaticArp=False, waitConnected=False)
        self.net.build()
        for ep in self.local_endpoints:
            pid = self.net[ep.name].pid
            run(["ip", "netns", "attach", ep.name, str(pid)])
            self._attached.append(ep.name)
        self.net.start()
        mtu = self.topo.spec.mtu
        for ep in self.local_endpoints:
            lines = ["link set lo up"] + [f"link set dev {n.dev} mtu {mtu}" for n in ep.nics]
            if self.topo.spec.gso_max_bytes:  # the senders' TCP builds no larger packet for HTB
                lines += [f"link set dev {n.dev} gso_max_size {self.topo.spec.gso_max_bytes}"
                          for n in ep.nics if n.kind in ("cnic", "host_port")]
            run(["ip", "-batch", "-"], ns=ep.name, stdin="\n".join(lines) + "\n")
        run(["ip", "-batch", "-"], stdin="".join(f"link set dev {n.bridge_dev} mtu {mtu}\n" for n in self.local_nics))
        self.apply_shaping(self.topo.spec.qos)
        nft = dscp_marking.nft_script(unreserved=ROOT_IPS)
        lo, hi = KV_PORT_RANGE
        for ep in self.local_endpoints:
            sysctls = list(TCP_SYSCTLS)
            if ep.kind != "storage":
                run(["nft", "-f", "-"], ns=ep.name, stdin=nft)
                # Keep the kernel from handing out kv-range ports as ephemeral source ports:
                # a model-class connection from such a port would be marked kv.
                sysctls.append(f"net.ipv4.ip_local_reserved_ports={lo}-{hi}")
            run(["sysctl", "-q", "-w", *sysctls], ns=ep.name)
        if self.transport == "rdma":
            self._add_rxe()
        if self.remotes:
            from testbed.fabric import remote

            t1 = time.monotonic()
            self._remote_up = True
            remote.up_parts(self.topo, self.remotes)
            remote.join_bridges(self.topo, {"compute": COMPUTE_BRIDGE, "storage": STORAGE_BRIDGE}, self.tunnels_up)
            self.timings["remote_up_s"] = time.monotonic() - t1
        self.timings["up_s"] = time.monotonic() - t0
        return self

    # -- Soft-RoCE -------------------------------------------------------------
    def rdma_nics(self) -> list[Nic]:
        """The NICs that carry KV over RDMA: every engine's CNIC and every node's host port."""
        return [n for n in self.local_nics if n.kind in ("cnic", "host_port")]

    def rdma_mtu(self) -> int:
        """The RDMA MTU rxe derives from the links' MTU (4096 at 9000, 1024 at 1500)."""
        from dualpath.transport.rdma import rxe_mtu

        return rxe_mtu(self.topo.spec.mtu)

    def _add_rxe(self) -> None:
        from dualpath.transport.env import RdmaUnavailableError
        from dualpath.transport.rdma import rxe_device_name

        try:  # built in, or absent: `rdma link add` says which
            run(["modprobe", "rdma_rxe"], check=False)
        except Exception:
            pass
        for nic in self.rdma_nics():
            try:
                name = rxe_device_name(nic.ns)
            except ValueError as e:
                raise RdmaUnavailableError(f"transport 'rdma': {e}") from None
            try:
                run(["rdma", "link", "add", name, "type", "rxe", "netdev", nic.dev], ns=nic.ns)
            except Exception as e:
                raise RdmaUnavailableError(
                    f"transport 'rdma': cannot add a Soft-RoCE (rxe) device on {nic.dev} in {nic.ns} "
                    f"({' '.join(str(e).split())[:300]}): this kernel has no RDMA device support usable in "
                    f"a network namespace (rdma_rxe on a 7.x kernel: use the VM, scripts/vm.sh). The "
                    f"testbed does not fall back to TCP") from None
            self.rxe[nic.dev] = name

    def rxe_of(self, nic: Nic) -> str | None:
        return self.rxe.get(nic.dev)

    def apply_shaping(self, qos: bool) -> None:
        """(Re)shape every NIC; `qos` selects two classes or one FIFO on CNICs."""
        root_batch: list[str] = []
        root_del: list[str] = []
        for ep in self.local_endpoints:
            ns_batch = []
            for nic in ep.nics:
                # The host port stands for the DRAM side of the node's CNICs: same two classes.
                classes = qos and nic.kind in ("cnic", "host_port")
                mtu = self.topo.spec.mtu
                ns_batch.append(htb_batch(NicShape(nic.dev, nic.rate_bps, classes, mtu)))
                root_batch.append(htb_batch(NicShape(nic.bridge_dev, nic.rate_bps, classes, mtu)))
                root_del.append(unshape_batch(nic.bridge_dev))
            if self._shaped:  # may already be gone (a benchmark unshaped it): errors ignored
                run(["tc", "-force", "-batch", "-"], ns=ep.name, check=False,
                    stdin="".join(unshape_batch(n.dev) for n in ep.nics))
            run(["tc", "-batch", "-"], ns=ep.name, stdin="".join(ns_batch))
        if self._shaped:
            run(["tc", "-force", "-batch", "-"], check=False, stdin="".join(root_del))
        run(["tc", "-batch", "-"], stdin="".join(root_batch))
        self._shaped = True
        self.qos = qos

    def _refuse_if_taken(self) -> None:
        """Every testbed uses the same names, so a second one would fail half-way through its
        build, and tearing down that half would remove the first one's bridges (Mininet deletes
        switches by name). Refuse before anything is made."""
        left = find_leftovers()
        taken = left.namespaces + left.bridges + left.links
        if taken:
            shown = ", ".join(taken[:4]) + (f" and {len(taken) - 4} more" if len(taken) > 4 else "")
            raise FabricBusy(f"another testbed is up on this machine ({shown}); `dualpath status` says whose, "
                             "`dualpath down` stops it, `dualpath clean` removes what a dead one left")

    def down(self) -> None:
        """Remove everything up() made. Safe to call twice and after a partial up()."""
        # A second Ctrl-C must not cut the teardown short; it is delivered after.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            self._down()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def _down(self) -> None:
        errors = []
        t0 = time.monotonic()
        if self._remote_up:
            from testbed.fabric import remote

            errors += remote.down_parts(self.topo, self.remotes)
            for dev in self.tunnels_up:
                run(["ip", "link", "del", dev], check=False)
            self.tunnels_up.clear()
            self._remote_up = False
        # Processes started inside our namespaces would keep them alive, unseen, after
        # their names are gone: end them first.
        kill_processes_in(self._attached)
        for name in list(self.rxe.values()):  # also gone with its veth; explicit is quicker
            run(["rdma", "link", "delete", name], check=False)
        self.rxe.clear()
        if self.net is not None:
            try:
                self.net.stop()
            except Exception as e:  # keep tearing down the rest
                errors.append(f"mininet stop: {e}")
            self.net = None
        if self.containers or self.docker:
            from testbed.fabric import containers

            try:
                if containers.daemon_pid() is not None:  # the daemon is the testbed's: all of its
                    containers.remove_containers()  # containers are this fabric's
            except Exception as e:
                errors.append(f"containers: {e}")
            self.containers.clear()
            containers.stop_daemon()
        for name in self._attached:
            run(["ip", "netns", "del", name], check=False)
        self._attached.clear()
        self.timings["down_s"] = time.monotonic() - t0
        if errors:
            raise RuntimeError("; ".join(errors))

    def __enter__(self) -> "Fabric":
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc: object) -> None:
        self.down()
