"""The testbed's own bottleneck-free P/D range: the paper's method over the testbed's links.

The paper counts a CNIC's PCIe reads and writes and a node's DRAM bandwidth. The testbed has
neither: every NIC is a veth shaped by HTB in each direction on its own (tx on the namespace end,
rx on the bridge end, testbed/fabric/network.py), so its resources are, per direction,

    every node's SNIC (s*B), every node's host port (min(g*B, M): the DRAM side of its CNICs),
    every engine's CNIC (B), and the storage servers' NICs (the cluster's, shared by all nodes).

What each carries per hit byte comes from the read paths' hops (dualpath/accounting.py, which
every run's counters are checked against), with the miss and write-back bytes set to 0 as the
paper's method does. That differs from the paper's counts in three ways, and they move the bounds:
  * an H2D is one crossing, host port tx -> CNIC rx, not a CNIC read plus a CNIC write: the PE
    CNIC's tx carries only the PE path's WRITE, so the erratum's s <= g/2 becomes s <= g;
  * the PE path's WRITE into the DE buffer lands on the DE host port's rx, not on the DE CNIC:
    the DE CNIC rx sees each hit byte once (its H2D), so (g-s)/(2s) becomes (g-s)/s;
  * DRAM is not emulated as one shared budget: the host port shapes reads (tx) and writes (rx)
    apart, at min(g*B, M) each, and an SNIC writes into DRAM without crossing it. The DE host
    port tx carries the DE path's hits twice (to the PE, then the H2D) and the PE path's once:
    P/D <= h/s - 2, with h = min(g*B, M)/B, in place of the paper's DRAM bound.
With g*B <= M this gives s/(g-s) <= P/D <= (g-2s)/s: for the shipped g = 2, s = 0.25, 1/7 <= P/D
<= 6, against the paper's 7/2. The storage NICs add a bound on the cluster's size, (P+D)*s*B <=
their total rate, which the paper leaves out (the article's section 3.3: the 3FS cluster's
bandwidth). The disk is not shaped and is not a resource here.
"""
from __future__ import annotations

from dualpath.accounting import Nic, symbolic
from dualpath.analysis.method import Model, Resource

SNIC_RX = "SNIC rx"  # every node's SNIC together: the premise's resource (u = 1)
SNIC_TX = "SNIC tx"


def resource_name(nic: Nic, direction: str) -> str:
    """'PE CNIC rx', 'DE host port tx', 'storage NIC tx'; the SNICs of both sides are one."""
    if nic.kind == "snic":
        return SNIC_RX if direction == "rx" else SNIC_TX
    return f"{nic.label} {direction}"


def hit_counts() -> dict[tuple[str, str, str], tuple[int, int]]:
    """(side, kind, direction) -> (hit bytes per hit byte on the PE path, on the DE path), from
    the paths' hops with M = W = 0. Sides: "pe", "de", "storage"; SNICs keyed by their own side."""
    pe, de = symbolic("pe"), symbolic("de")
    out = {}
    for (nic, direction) in pe:
        out[(nic.side, nic.kind, direction)] = (_coef(pe[(nic, direction)]), _coef(de[(nic, direction)]))
    return out


def _coef(expr) -> int:
    return dict(expr.terms).get("H", 0)


def testbed_model(g: int, cnic_bps: float, snic_bps: float, host_port_bps: float,
                  storage_bps: float) -> Model:
    """The testbed's resources for one topology's rates (bit/s; `storage_bps` is all storage
    servers' NICs together). Every direction of every NIC kind is a resource, those that carry no
    hit bytes too (utilisation 0 by the premise: they carry miss KV, write-back, control)."""
    for name, v in (("g", g), ("cnic_bps", cnic_bps), ("snic_bps", snic_bps), ("host_port_bps", host_port_bps),
                    ("storage_bps", storage_bps)):
        if not v > 0:
            raise ValueError(f"testbed_model: {name} must be > 0, got {v!r}")
    counts = hit_counts()
    res = []
    for direction in ("rx", "tx"):  # both sides' SNICs are one resource: the premise's SNIC
        a = counts[("pe", "snic", direction)][0]
        b = counts[("de", "snic", direction)][1]
        res.append(Resource(SNIC_RX if direction == "rx" else SNIC_TX, "all", 1, snic_bps, a, b))
    for nic in Nic:
        if nic.kind == "snic":
            continue
        members, rate = {"host_port": (1, host_port_bps), "cnic": (g, cnic_bps),
                         "storage_nic": (1, storage_bps)}[nic.kind]
        side = "cluster" if nic is Nic.STORAGE else nic.side
        for direction in ("rx", "tx"):
            a, b = counts[(nic.side, nic.kind, direction)]
            res.append(Resource(resource_name(nic, direction), side, members, rate, a, b))
    return Model("testbed", snic_rate=snic_bps, snic=SNIC_RX, resources=tuple(res))


def members(model: Model) -> dict[str, tuple[str, str, str]]:
    """resource name -> (side, NIC kind, direction): which emulated NICs a resource is, for
    reading its counters ("all": the SNICs of every node; "cluster": the storage servers')."""
    out = {}
    for nic in Nic:
        for direction in ("rx", "tx"):
            name = resource_name(nic, direction)
            if name in {r.name for r in model.resources}:
                side = "all" if nic.kind == "snic" else ("cluster" if nic is Nic.STORAGE else nic.side)
                out[name] = (side, nic.kind, direction)
    return out
