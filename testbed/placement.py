"""Where a topology's nodes run when it spans several servers, and what must cross between them.

Pure logic over a validated Topology (DESIGN.md section 12, docs/cluster.md): which server holds
each node and storage server, the emulated rate that can cross each server pair against the
physical NIC that carries it, the gretap tunnels that join the servers' bridges, and the MTU
those tunnels need. Nothing here touches a server; testbed/fabric/remote.py does.

Every server keeps its own compute and storage bridges. A cross-server link is shaped once, at
its namespace end, exactly as on one machine; the tunnel only carries what the shaping let
through, plus GRE's bytes per packet.
"""
from __future__ import annotations

from dataclasses import dataclass

from dualpath.naming import PREFIX
from testbed.topology import Topology, _fmt
from testbed.topology_servers import ServerSpec, unit_names


# A tunnelled packet on the wire, beyond the inner packet. gretap: outer IPv4 (20), GRE with a key
# (8) and the inner Ethernet header (14); Mininet's cluster edition uses keyed gretap too. VXLAN:
# outer IPv4 (20), UDP (8), VXLAN (8), inner Ethernet (14).
TUNNEL_OVERHEAD_BYTES = {"gretap": 42, "vxlan": 50}


VXLAN_PORT = 4789  # IANA's; the kernel's default without dstport is Linux's old 8472


BRIDGES = ("compute", "storage")


# Tunnel keys (GRE keys, VXLAN network ids): distinct per bridge and server pair, and far from
# Mininet's own counter (1, 2, ...), so a cluster-edition tunnel never shares one with ours. Below
# 2**24, the VXLAN id's size.
_KEY_BASE = 4_450_000


LOCAL = ServerSpec(name="local")  # the server of a topology that names none


@dataclass(frozen=True)
class Unit:
    """What one `place:` entry moves: a node (host and engine namespaces) or a storage server,
    with the emulated rate its NICs can send into each bridge."""

    name: str  # p0, d1, s0
    engines: int
    compute_bps: int
    storage_bps: int


@dataclass(frozen=True)
class Crossing:
    """One server pair: the most emulated traffic that can cross it in each direction (the
    smaller of what one side's NICs can send and the other's can take), per bridge."""

    a: str
    b: str
    compute_bps: int
    storage_bps: int
    physical_bps: int  # the slower of the two servers' NICs

    @property
    def total_bps(self) -> int:
        return self.compute_bps + self.storage_bps

    @property
    def holds(self) -> bool:
        return self.total_bps <= self.physical_bps


@dataclass(frozen=True)
class Tunnel:
    """One tunnel device on each end of a server pair, enslaved to that bridge on both."""

    kind: str  # "gretap" or "vxlan"
    bridge: str  # "compute" or "storage"
    a: str
    b: str
    dev: str  # the same name on both servers
    key: int


def servers(topo: Topology) -> list[ServerSpec]:
    """The topology's servers, this machine first (a topology without servers: this machine)."""
    return list(topo.spec.servers) or [LOCAL]


def units(topo: Topology) -> list[Unit]:
    s = topo.spec
    node_bps = s.engines_per_node * topo.cnic_bps + topo.host_port_bps
    out = []
    for name in unit_names(s.prefill_nodes, s.decode_nodes, s.storage.servers):
        if name.startswith("s"):
            out.append(Unit(name, 0, 0, topo.storage_nic_bps))
        else:
            out.append(Unit(name, s.engines_per_node, node_bps, topo.snic_bps))
    return out


def placement(topo: Topology) -> dict[str, str]:
    """Unit name -> server name; what `place:` leaves out stays on the first server."""
    first = servers(topo)[0].name
    return {u.name: topo.spec.place.get(u.name, first) for u in units(topo)}


def spans_servers(topo: Topology) -> bool:
    return len(set(placement(topo).values())) > 1


def server_of_namespace(topo: Topology, ns: str) -> str:
    """The server that holds a namespace (dpt-d0e1 -> d0's server); the root namespace's ends
    (the conductor's and `dualpath up`'s addresses) are on the first server."""
    short = ns.removeprefix(f"{PREFIX}-")
    unit = short.split("e")[0] if short[:1] in ("p", "d") else short
    return placement(topo).get(unit, servers(topo)[0].name)


def crossings(topo: Topology) -> list[Crossing]:
    """Every pair of servers that both hold something, in the order of `servers:`."""
    where = placement(topo)
    by_server: dict[str, list[Unit]] = {}
    for u in units(topo):
        by_server.setdefault(where[u.name], []).append(u)
    held = [v for v in servers(topo) if v.name in by_server]
    out = []
    for i, va in enumerate(held):
        for vb in held[i + 1:]:
            ua, ub = by_server[va.name], by_server[vb.name]
            out.append(Crossing(
                va.name, vb.name,
                min(sum(u.compute_bps for u in ua), sum(u.compute_bps for u in ub)),
                min(sum(u.storage_bps for u in ua), sum(u.storage_bps for u in ub)),
                int(min(va.nic_gbps, vb.nic_gbps) * 1e9)))
    return out


def tunnels(topo: Topology) -> list[Tunnel]:
    """One tunnel per bridge per server pair that traffic crosses. Names fit Linux's 15 bytes:
    dpt-gc0-1 (gretap) or dpt-vc0-1 (VXLAN) joins servers 0 and 1's compute bridges."""
    index = {v.name: i for i, v in enumerate(servers(topo))}
    kind = topo.spec.tunnel
    out = []
    for c in crossings(topo):
        i, j = index[c.a], index[c.b]
        for k, bridge in enumerate(BRIDGES):
            out.append(Tunnel(kind, bridge, c.a, c.b, f"{PREFIX}-{kind[0]}{bridge[0]}{i}-{j}",
                              _KEY_BASE + (i * 100 + j) * 2 + k))
    return out


def overhead_bytes(topo: Topology) -> int:
    return TUNNEL_OVERHEAD_BYTES[topo.spec.tunnel]


def mtu_problems(topo: Topology) -> list[str]:
    """Each server pair whose path MTU cannot carry the topology's MTU inside its tunnel unfragmented."""
    spec = {v.name: v for v in servers(topo)}
    extra = overhead_bytes(topo)
    need = topo.spec.mtu + extra
    out = []
    for c in crossings(topo):
        have = min(spec[c.a].mtu, spec[c.b].mtu)
        if have < need:
            out.append(f"servers {c.a} and {c.b}: the topology's mtu {topo.spec.mtu} plus {topo.spec.tunnel}'s {extra} B "
                       f"needs a path MTU of {need}, they have {have}; fix: set mtu: to at most "
                       f"{have - extra}, or give both servers' NICs (and their mtu:) {need} or more")
    return out


def overhead_fraction(topo: Topology) -> float:
    """The tunnel's bytes on the physical wire per byte the shaped NICs counted, for full-size
    packets (a packet of `mtu` bytes plus its 14-byte Ethernet header, as a veth counts it)."""
    return overhead_bytes(topo) / (topo.spec.mtu + 14)


def describe(topo: Topology) -> list[str]:
    """`dualpath topo`'s lines for a topology that names servers: what each holds, what can
    cross each pair against its physical NIC, and the tunnels."""
    if not topo.spec.servers:
        return []
    where = placement(topo)
    lines = [f"servers: {len(topo.spec.servers)}; the conductor runs on {servers(topo)[0].name}"]
    for v in servers(topo):
        held = [u for u in units(topo) if where[u.name] == v.name]
        what = ", ".join(f"{u.name} ({u.engines} engines)" if u.engines else u.name for u in held) or "nothing"
        dest = "this machine" if v.ssh is None else f"ssh {v.ssh}" + (f" port {v.port}" if v.port else "")
        lines.append(f"  {v.name} ({dest}; NIC {v.nic_gbps:g} Gbit/s, path MTU {v.mtu}): {what}")
        if len(topo.spec.servers) > 2:  # with two, the pair's line says it
            out, nic = _sends(topo, v.name), int(v.nic_gbps * 1e9)
            lines.append(f"    to all the others at once: at most {_fmt(out)} against its {_fmt(nic)}: "
                         + ("holds" if out <= nic else "EXCEEDS its NIC"))
    for c in crossings(topo):
        lines.append(f"  {c.a} <-> {c.b}: at most {_fmt(c.total_bps)} each way (compute {_fmt(c.compute_bps)}, storage "
                     f"{_fmt(c.storage_bps)}) against {_fmt(c.physical_bps)}: "
                     + ("holds" if c.holds else "EXCEEDS the physical NIC: lower scale or use faster NICs"))
    names = [t.dev for t in tunnels(topo)]
    if names:
        lines.append(f"  tunnels: {', '.join(names)} ({topo.spec.tunnel}; {overhead_bytes(topo)} B per packet, "
                     f"{overhead_fraction(topo):.2%} at mtu {topo.spec.mtu}, counted apart from the NICs' bytes)")
    lines.extend(f"  PROBLEM: {p}" for p in problems(topo))
    return lines


def problems(topo: Topology) -> list[str]:
    """What stops the placement from running as written: an MTU the tunnels cannot carry, a
    pair or server whose emulated traffic exceeds its physical NIC."""
    out = mtu_problems(topo)
    out += [f"servers {c.a} and {c.b}: up to {_fmt(c.total_bps)} of emulated traffic each way exceeds the slower NIC's "
            f"{_fmt(c.physical_bps)}; fix: lower scale, or state faster NICs (nic_gbps)" for c in crossings(topo) if not c.holds]
    if len(topo.spec.servers) > 2:
        out += [f"server {v.name}: up to {_fmt(_sends(topo, v.name))} to the others at once exceeds its NIC's "
                f"{_fmt(v.nic_gbps * 1e9)}; fix: lower scale, or place fewer nodes apart from it"
                for v in servers(topo) if _sends(topo, v.name) > v.nic_gbps * 1e9]
    return out


def _sends(topo: Topology, server: str) -> int:
    """The most one server can send to all the others at once: its pairs' crossings, summed
    (they share its one physical NIC)."""
    return sum(c.total_bps for c in crossings(topo) if server in (c.a, c.b))
