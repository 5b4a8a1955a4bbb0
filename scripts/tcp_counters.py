#!/usr/bin/env python3
"""Where TCP re-sends bytes in a run: one e2e run on 1p1d (tests/test_e2e.py's workload, every
mode), then each namespace's TCP counters (cumulative since the fabric made it), the qdisc drops,
and per mode the largest measured/expected KV bytes of any NIC.

    .venv/bin/python scripts/tcp_counters.py                         # the fabric as it ships
    .venv/bin/python scripts/tcp_counters.py --tail-loss-probes on   # the kernel's default

`--tail-loss-probes on` sets net.ipv4.tcp_early_retrans back to the kernel's 3 in every namespace
after bring-up: the setting the fabric turns off (testbed/fabric/network.py, TCP_SYSCTLS). Needs root and
the testbed to itself (about 90 s).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

COUNTERS = ("Tcp:RetransSegs", "Tcp:OutSegs", "TcpExt:TCPLossProbes", "TcpExt:TCPDSACKRecv",
            "TcpExt:TCPFastRetrans", "TcpExt:TCPTimeouts", "TcpExt:TCPSpuriousRTOs")


def tcp_counters(ns: str) -> dict[str, int]:
    """The namespace's Tcp: and TcpExt: counters (/proc/net/snmp and netstat are per namespace)."""
    from testbed.fabric.shell import run

    out: dict[str, int] = {}
    for f in ("/proc/net/snmp", "/proc/net/netstat"):
        lines = run(["cat", f], ns=ns).splitlines()
        for names, values in zip(lines[::2], lines[1::2]):
            names, values = names.split(), values.split()
            if names[0] in ("Tcp:", "TcpExt:"):
                out.update({names[0] + k: int(v) for k, v in zip(names[1:], values[1:]) if v.lstrip("-").isdigit()})
    return out


def _drops(tc_stats: str) -> int:
    """Packets dropped, summed over the qdiscs of `tc -s qdisc` output."""
    return sum(int(line.split("dropped")[1].split(",")[0]) for line in tc_stats.splitlines() if "dropped" in line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tail-loss-probes", choices=["off", "on"], default="off")
    args = ap.parse_args()
    from dualpath.workload import demo_workload, generate
    from testbed.api import demo_checkpoint
    from testbed.experiments.ablation import run_e2e, run_geometry
    from testbed.experiments.results import summarize
    from testbed.fabric.network import Fabric
    from testbed.fabric.shell import run
    from testbed.topology import load_topology

    topo = load_topology(REPO / "topologies" / "1p1d.yaml")
    ckpt = demo_checkpoint()
    wl = generate(demo_workload(seed=1, n_trajectories=3, turns_mean=4.0, turns_min=3))
    with Fabric(topo) as fab, tempfile.TemporaryDirectory(prefix="dpt-tcp-") as scratch:
        if args.tail_loss_probes == "on":
            for ep in fab.endpoints:
                run(["sysctl", "-q", "-w", "net.ipv4.tcp_early_retrans=3"], ns=ep.name)
        results = run_e2e(fab, wl, ckpt, Path(scratch), progress=lambda m: None)
        counters = {ep.name: tcp_counters(ep.name) for ep in fab.endpoints}
        drops = {ep.name: _drops(run(["tc", "-s", "qdisc"], ns=ep.name)) for ep in fab.endpoints}
        bridge_drops = sum(_drops(run(["tc", "-s", "qdisc", "show", "dev", n.bridge_dev])) for n in fab.nics)
    summary = summarize(results, wl, run_geometry(ckpt), topo)
    print(f"tail loss probes {args.tail_loss_probes}; counters per namespace since bring-up:")
    print(f"  {'namespace':<10}" + "".join(f"{c.split(':')[1]:>16}" for c in COUNTERS) + f"{'qdisc drops':>13}")
    for ns, c in counters.items():
        print(f"  {ns:<10}" + "".join(f"{c.get(k, 0):>16}" for k in COUNTERS) + f"{drops[ns]:>13}")
    print(f"  the NICs' bridge-side (receiving) qdiscs dropped {bridge_drops} packets")
    print("KV bytes per NIC, measured / expected: the largest of any NIC per mode (tolerance 2 %)")
    for mode, m in summary["modes"].items():
        rows = [r for r in m["kv_bytes_vs_expected"]["per_nic"] if r["expected"]]
        worst = max(rows, key=lambda r: r["measured"] / r["expected"]) if rows else None
        print(f"  {mode:<12} " + (f"{worst['measured'] / worst['expected']:.4f} ({worst['nic']}); "
                                  if worst else "no KV; ")
              + f"{m['kv_bytes_vs_expected']['within']}/{m['kv_bytes_vs_expected']['nics']} NICs within")
    return 0


if __name__ == "__main__":
    sys.exit(main())
