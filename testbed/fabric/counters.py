"""Kernel byte counters of every emulated NIC, keyed the way dualpath.accounting keys them.

A NIC's transmit side is the HTB on its namespace end; its receive side is the
HTB on its bridge end (root namespace). On CNICs and host ports the kv class
carries the KV transport only (control rides the model class); SNICs and
storage NICs carry storage traffic only.

HTB counts each segment's full frame, so the TCP payload is the bytes minus
66 per packet (Ethernet 14, IPv4 20, TCP with timestamps 32). Subtracting it
also drops pure ACKs, which carry no payload. What remains beyond the KV itself
is the transport's own messages (UCX request headers, store frame headers),
reported as protocol overhead.

HTB also counts every segment TCP sends again, and the path definitions count each KV byte
once. So each socket's own count of re-sent payload (tcpi_bytes_retrans, read with `ss -ti`
in every namespace) is charged to the NIC that sent it (tx) and the NIC it went to (rx), and
taken off the measured payload before it is compared. Only sockets open at the end of a mode
are seen; the connections that carry KV (UCX's and the store clients') stay open for the run.

With transport rdma the kv class of a CNIC or host port carries RoCEv2 packets
(58 bytes of headers each: Ethernet, IPv4, UDP, BTH, ICRC), counted exactly by
the NIC's rxe device (hw_counters sent_pkts on transmit, rcvd_pkts on receive),
beside a few TCP packets of UCX's wire-up: each kind loses its own headers.
What remains beyond the KV is RoCE's extension headers (RETH, AETH), ACKs and
READ requests: protocol overhead again.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from dualpath.accounting import STORAGE_OWNER
from dualpath.traffic_classes import KV, KV_PORT_RANGE, MODEL
from emulators import dscp_marking
from emulators.nic import ROOT_CLASS, class_for, parse_class_drops, parse_class_packets, parse_class_stats
from testbed.fabric.shell import run
from testbed.fabric.network import Fabric

Key = tuple[str, str, str]  # (owner, kind, direction)
Socket = tuple[str, str, int, str, int]  # (namespace, local ip, port, peer ip, port)
FRAME_HEADER_BYTES = 14 + 20 + 32
ROCE_FRAME_HEADER_BYTES = 14 + 20 + 8 + 12 + 4  # = dualpath.transport.rdma.ROCE_HEADER_BYTES


def _owner(fab: Fabric, nic) -> str:
    return STORAGE_OWNER if nic.kind == "storage_nic" else nic.ns


@dataclass
class Snapshot:
    kv_payload: dict[Key, int] = field(default_factory=dict)  # TCP payload in the kv class
    kv_wire: dict[Key, int] = field(default_factory=dict)  # frames, as shaped
    model_wire: dict[Key, int] = field(default_factory=dict)  # control
    drops: dict[Key, int] = field(default_factory=dict)
    kv_pkts: dict[Key, int] = field(default_factory=dict)  # frames in the kv class (or the FIFO)
    roce_pkts: dict[Key, int] = field(default_factory=dict)  # of them RoCE, by the NIC's rxe device
    rxe: dict[str, dict[str, int]] = field(default_factory=dict)  # every rxe device's hw_counters
    # TCP segments each namespace sent again: HTB counts a retransmitted segment's bytes once more
    retransmitted: dict[str, int] = field(default_factory=dict)
    # per socket with re-sent payload: its cumulative bytes and the NIC keys they cross
    resent_sockets: dict[Socket, tuple[int, tuple[Key, ...]]] = field(default_factory=dict)
    kv_resent: dict[Key, int] = field(default_factory=dict)  # of kv_payload, re-sent (in a delta)


def snapshot(fab: Fabric) -> Snapshot:
    """Counters per NIC and direction, from HTB (and, with transport rdma, the rxe devices)."""
    snap = Snapshot()
    rxe = {}
    if getattr(fab, "rxe", None):
        from dualpath.transport.rdma import read_counters

        rxe = read_counters()
        snap.rxe = {d: c for d, c in rxe.items() if d in fab.rxe.values()}
    for nic in fab.nics:
        classes = _has_classes(fab, nic)
        dev_counters = rxe.get(fab.rxe_of(nic) or "", {}) if rxe else {}
        for direction, dev, root in (("tx", nic.dev, False), ("rx", nic.bridge_dev, True)):
            stats = _nic_counters(fab, nic.ns, dev, root)
            key = (_owner(fab, nic), nic.kind, direction)
            kv_b, kv_p, _ = stats.get(class_for(True, KV) if classes else ROOT_CLASS, (0, 0, 0))
            roce = dev_counters.get("sent_pkts" if direction == "tx" else "rcvd_pkts", 0)
            _add(snap.kv_wire, key, kv_b)
            _add(snap.kv_pkts, key, kv_p)
            _add(snap.roce_pkts, key, roce)
            # headers per packet kind; cumulative counters, so a delta subtracts the same way
            _add(snap.kv_payload, key, kv_b - FRAME_HEADER_BYTES * kv_p
                 + (FRAME_HEADER_BYTES - ROCE_FRAME_HEADER_BYTES) * roce)
            if classes:
                _add(snap.model_wire, key, stats.get(class_for(True, MODEL), (0, 0, 0))[0])
            _add(snap.drops, key, sum(d for c, (_, _, d) in stats.items() if c != ROOT_CLASS))
    if getattr(fab, "net", None) is not None:  # a live Mininet (a stand-in fabric has none)
        by_ip = {nic.ip: nic for nic in fab.nics}
        for ep in fab.endpoints:
            snmp, sockets = _tcp_state(fab, ep.name)
            snap.retransmitted[ep.name] = retransmitted_segments(snmp)
            for (lip, lport, rip, rport), n in parse_ss_resent(sockets).items():
                keys = tuple((_owner(fab, nic), nic.kind, direction)
                             for nic, direction in ((by_ip.get(lip), "tx"), (by_ip.get(rip), "rx"))
                             if nic is not None and _in_measured_class(fab, nic, lport, rport))
                snap.resent_sockets[(ep.name, lip, lport, rip, rport)] = (n, keys)
    return snap


_SPLIT = "--dpt-split--"  # between the two outputs of _tcp_state's one remote command


def _tcp_state(fab: Fabric, ns: str) -> tuple[str, str]:
    """(/proc/net/snmp, `ss -tinHO`) of a namespace: read here, or over SSH on the server that
    holds it (one command for both)."""
    if fab.server_of(ns) is None:
        try:
            snmp = Path(f"/proc/{fab.net[ns].pid}/net/snmp").read_text()
        except OSError:
            snmp = ""
        return snmp, run(["ss", "-tinHO"], ns=ns, check=False)
    out = fab.run_in(ns, ["sh", "-c", f"cat /proc/net/snmp; echo {_SPLIT}; ss -tinHO"])
    snmp, _, sockets = out.partition(_SPLIT + "\n")
    return snmp, sockets


def _has_classes(fab: Fabric, nic) -> bool:
    """Whether the NIC's HTB has a class per traffic class (else one FIFO counts everything)."""
    return bool(fab.qos) and nic.kind in ("cnic", "host_port")


def _in_measured_class(fab: Fabric, nic, lport: int, rport: int) -> bool:
    """Whether a connection's bytes are in the NIC's counted payload: its kv class (the KV
    port range) where the NIC has classes, everything on the others."""
    if not _has_classes(fab, nic):
        return True
    lo, hi = KV_PORT_RANGE
    return lo <= lport <= hi or lo <= rport <= hi


_SS_ADDR = re.compile(r"(\d+\.\d+\.\d+\.\d+):(\d+)")
_SS_RESENT = re.compile(r"\bbytes_retrans:(\d+)")


def parse_ss_resent(text: str) -> dict[tuple[str, int, str, int], int]:
    """Payload bytes each IPv4 TCP socket has sent again, from `ss -tinHO` (one line per
    socket; ss leaves bytes_retrans out while it is 0, so those sockets are left out too)."""
    out = {}
    for line in text.splitlines():
        addrs, resent = _SS_ADDR.findall(line)[:2], _SS_RESENT.search(line)
        if len(addrs) == 2 and resent and int(resent.group(1)):
            (lip, lport), (rip, rport) = addrs
            out[(lip, int(lport), rip, int(rport))] = int(resent.group(1))
    return out


def retransmitted_segments(snmp: str) -> int:
    """Tcp RetransSegs from a namespace's /proc/net/snmp text (0 if it has none)."""
    rows = [line.split() for line in snmp.splitlines() if line.startswith("Tcp:")]
    if len(rows) < 2 or "RetransSegs" not in rows[0]:
        return 0
    return int(rows[1][rows[0].index("RetransSegs")])


def _add(d: dict[Key, int], key: Key, v: int) -> None:
    d[key] = d.get(key, 0) + v


def delta(after: Snapshot, before: Snapshot) -> Snapshot:
    def d(a: dict[Key, int], b: dict[Key, int]) -> dict[Key, int]:
        return {k: v - b.get(k, 0) for k, v in a.items()}

    rxe = {dev: {k: v - before.rxe.get(dev, {}).get(k, 0) for k, v in c.items()} for dev, c in after.rxe.items()}
    resent: dict[Key, int] = {}
    for sock, (n, keys) in after.resent_sockets.items():  # a socket absent before was opened since
        for key in keys:
            _add(resent, key, n - before.resent_sockets.get(sock, (0, ()))[0])
    return Snapshot(d(after.kv_payload, before.kv_payload), d(after.kv_wire, before.kv_wire),
                    d(after.model_wire, before.model_wire), d(after.drops, before.drops),
                    d(after.kv_pkts, before.kv_pkts), d(after.roce_pkts, before.roce_pkts), rxe,
                    d(after.retransmitted, before.retransmitted), kv_resent=resent)


def first_sent(snap: Snapshot) -> dict[Key, int]:
    """A delta's kv payload without what TCP sent again: each KV byte once, as the paths count it."""
    return {k: v - snap.kv_resent.get(k, 0) for k, v in snap.kv_payload.items()}


def class_bytes(dev: str, ns: str | None = None) -> dict[str, int]:
    return parse_class_stats(_show(dev, ns))


def class_counters(dev: str, ns: str | None = None) -> dict[str, tuple[int, int, int]]:
    """(bytes, packets, drops) per HTB class id of a device."""
    return _parse_counters(_show(dev, ns))


def _parse_counters(text: str) -> dict[str, tuple[int, int, int]]:
    b, p, d = parse_class_stats(text), parse_class_packets(text), parse_class_drops(text)
    return {c: (b[c], p[c], d[c]) for c in b}


def _elsewhere(fab: Fabric, ns: str) -> bool:
    """Whether another server holds namespace `ns` (a stand-in fabric has no servers)."""
    return getattr(fab, "server_of", lambda n: None)(ns) is not None


def _nic_counters(fab: Fabric, ns: str, dev: str, root: bool) -> dict[str, tuple[int, int, int]]:
    """class_counters of a NIC end, read on the server that holds namespace `ns` (root: its bridge
    end, in that server's root namespace)."""
    if not _elsewhere(fab, ns):
        return class_counters(dev, None if root else ns)
    return _parse_counters(fab.run_in(ns, ["tc", "-s", "class", "show", "dev", dev], root))


def _show(dev: str, ns: str | None) -> str:
    return run(["tc", "-s", "class", "show", "dev", dev], ns=ns)


def dscp_counters(fab: Fabric) -> dict[str, dict[str, tuple[int, int]]]:
    """Per namespace (every host and engine), (bytes, packets) it has sent in each traffic class,
    by the DS field on the wire (nftables, emulators/dscp_marking.py): true whether HTB has two
    classes or one FIFO. Storage namespaces have no marking table and are left out."""
    return {ep.name: ns_dscp_counters(ep.name, run_in=fab.run_in if _elsewhere(fab, ep.name) else None)
            for ep in fab.endpoints if ep.kind != "storage"}


def ns_dscp_counters(ns: str, received: bool = False, run_in=None) -> dict[str, tuple[int, int]]:
    """(bytes, packets) per traffic class that namespace `ns` has sent (or `received`); `run_in`:
    a fabric's way to reach a namespace on another server (default: this machine's)."""
    argv = ["nft", "-j", "list", "counters", "table", "ip", dscp_marking.TABLE]
    return dscp_marking.parse_counters(run_in(ns, argv) if run_in else run(argv, ns=ns), received)


def dscp_delta(after: dict[str, dict[str, tuple[int, int]]], before: dict[str, dict[str, tuple[int, int]]]
               ) -> dict[str, dict[str, tuple[int, int]]]:
    return {ns: {c: (b - before.get(ns, {}).get(c, (0, 0))[0], p - before.get(ns, {}).get(c, (0, 0))[1])
                 for c, (b, p) in per.items()} for ns, per in after.items()}
