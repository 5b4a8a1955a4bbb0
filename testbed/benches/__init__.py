"""`dualpath bench transport|store`: the data plane against iperf3 and fio, measured side by side.

Each figure is a ratio taken in one run on the same link or disk: NIXL READ and
WRITE between two engine namespaces against iperf3 between the same two, once
unshaped and once shaped at the CNIC rate; store reads through a shaped SNIC
against iperf3 on that SNIC; unshaped store reads against fio on the same disk.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from dualpath.traffic_classes import KV, MODEL
from emulators.kvstore.launch import ServerProcess
from emulators.nic import class_for
from testbed.counters import class_bytes
from testbed.fabric import Fabric, Nic
from testbed.iperf import flow
from testbed.shell import ns_argv, run

REPO = Path(__file__).resolve().parent.parent


def _unshape(nics: list[Nic]) -> None:
    for n in nics:
        run(["tc", "qdisc", "del", "dev", n.dev, "root"], ns=n.ns, check=False)
        run(["tc", "qdisc", "del", "dev", n.bridge_dev, "root"], check=False)


def _json_tail(out: str) -> dict[str, Any]:
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON result in: {out[-300:]!r}")


def _transport_pair(fab: Fabric, args: list[str], timeout_s: float) -> dict[str, Any]:
    """Target in d0e0, initiator in p0e0 (helper-built `testbed.benches.transport_nixl`)."""
    tgt, ini = fab.endpoint("d0e0"), fab.endpoint("p0e0")
    tn, inn = tgt.nic("cnic"), ini.nic("cnic")
    py = [sys.executable, "-m", "testbed.benches.transport_nixl"]
    target = subprocess.Popen(ns_argv(tgt.name, [*py, "--role", "target", "--iface", tn.dev, "--bind-ip", tn.ip,
                                                 "--max-time", str(int(timeout_s)), *args]),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
    try:
        out = run([*py, "--role", "initiator", "--iface", inn.dev, "--peer-ip", tn.ip, *args],
                  ns=ini.name, timeout=timeout_s)
    finally:
        try:
            target.wait(timeout=10)
        except subprocess.TimeoutExpired:
            target.kill()
            target.wait()
    return _json_tail(out)


def bench_transport(fab: Fabric, progress: Callable[[str], None] = print) -> dict[str, Any]:
    cn = [fab.endpoint("p0e0").nic("cnic"), fab.endpoint("d0e0").nic("cnic")]
    res: dict[str, Any] = {"link": f"{cn[0].dev} -> {cn[1].dev}", "cnic_rate_bps": cn[0].rate_bps}
    common = ["--iperf3", "--rounds", "3", "--reps", "3", "--iperf-seconds", "3", "--ndesc", "1", "64",
              "--sub-ndesc", "256"]
    progress("  transport, unshaped veth ...")
    _unshape(cn)
    try:
        res["unshaped"] = _transport_pair(fab, [*common, "--size", str(64 << 20)], 300)
    finally:
        fab.apply_shaping(fab.qos)
    progress("  transport, shaped at the CNIC rate ...")
    res["shaped"] = _transport_pair(fab, [*common, "--size", str(32 << 20)], 300)
    progress("  transport bytes by HTB class ...")
    before = {c.name: class_bytes(cn[0].bridge_dev).get(class_for(True, c), 0) for c in (KV, MODEL)}
    res["check"] = _transport_pair(fab, ["--mode", "check", "--size", str(16 << 20)], 120)
    after = {c.name: class_bytes(cn[0].bridge_dev).get(class_for(True, c), 0) for c in (KV, MODEL)}
    res["class_bytes_into_initiator"] = {k: after[k] - before[k] for k in after}
    return res


def bench_store(fab: Fabric, scratch: Path, progress: Callable[[str], None] = print) -> dict[str, Any]:
    from testbed.benches.store_fio import bench_store_vs_fio

    store_ep = next(e for e in fab.endpoints if e.kind == "storage")
    node = fab.endpoint("p0")
    snic, st = node.nic("snic"), store_ep.nic("storage_nic")
    res: dict[str, Any] = {"snic_rate_bps": snic.rate_bps}
    progress("  store through the shaped SNIC vs iperf3 on it ...")
    sp = ServerProcess(scratch / "store", 2 << 30, listen=f"{st.ip}:7001", argv_prefix=ns_argv(store_ep.name, []),
                       log_path=scratch / "store.log")
    sp.start()
    try:
        ratios, store_gbps, iperf_gbps = [], [], []
        for i in range(3):  # interleaved: both sides of each ratio see the same machine
            ip = flow(store_ep.name, node.name, snic.ip, 5301, 3.0)
            out = run([sys.executable, "-m", "testbed.store_probe", "--store", sp.address_str, "--blocks", "96",
                       "--block-bytes", str(256 << 10), "--namespace", f"snic-{i}"], ns=node.name, timeout=120)
            probe = _json_tail(out)
            if not probe["exact"]:
                raise RuntimeError("store probe read back wrong bytes")
            store_gbps.append(probe["read_GBps"])
            iperf_gbps.append(ip.goodput_bps / 8e9)
            ratios.append(store_gbps[-1] / iperf_gbps[-1])
        res["shaped"] = {"store_GBps": store_gbps, "iperf3_GBps": iperf_gbps, "ratios": ratios,
                         "ratio_median": sorted(ratios)[1]}
    finally:
        sp.stop()
    progress("  store unshaped (loopback) vs fio on the same disk, 1 and 2 servers ...")
    res["unshaped_vs_fio"] = bench_store_vs_fio(scratch, repeats=3)
    res["unshaped_vs_fio_2_servers"] = bench_store_vs_fio(scratch, repeats=3, n_servers=2)
    return res
