"""`dualpath bench transport|store`: the data plane against iperf3 and fio, measured side by side.

Each figure is a ratio taken in one run on the same link or disk: NIXL READ and
WRITE between two engine namespaces against iperf3 between the same two, once
unshaped and once shaped at the CNIC rate; store reads through a shaped SNIC
against iperf3 on that SNIC; unshaped store reads against fio on the same disk.

With `--transport rdma` (Soft-RoCE, in the VM) the reference is perftest on the
same rxe devices: NIXL READ against ib_read_bw and WRITE against ib_write_bw,
unshaped and shaped at RDMA_SHAPED_BPS (what rxe carries under QEMU TCG), with
the same traffic class (so the same HTB class). Every leg reads the rxe devices'
hw_counters and fails when the KV bytes did not cross RDMA.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from dualpath.traffic_classes import KV, MODEL
from emulators.kvstore.launch import ServerProcess
from emulators.nic import NicShape, class_for, htb_batch, unshape_batch
from testbed.fabric.counters import class_bytes
from testbed.fabric.network import Fabric, Nic
from testbed.fabric.iperf import flow
from testbed.fabric.shell import ns_argv, run
from testbed.paths import REPO



def _unshape(nics: list[Nic]) -> None:
    for n in nics:
        run(["tc", "qdisc", "del", "dev", n.dev, "root"], ns=n.ns, check=False)
        run(["tc", "qdisc", "del", "dev", n.bridge_dev, "root"], check=False)


def _json_tail(out: str) -> dict[str, Any]:
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON result in: {out[-300:]!r}")


# Soft-RoCE under QEMU TCG carries about 0.1-0.4 Gbit/s: shape below that, so the link, not
# the emulated CPU, sets the rate (../shared/notes/softroce-vm: HTB at 50 mbit held rxe at 43).
RDMA_SHAPED_BPS = 50_000_000


def _transport_pair(fab: Fabric, args: list[str], timeout_s: float, env: dict | None = None) -> dict[str, Any]:
    """Target in d0e0, initiator in p0e0 (helper-built `testbed.calibrate.benches.transport_nixl`).

    With `--transport rdma` in `args` both start with the system libibverbs preloaded
    (dualpath/transport/rdma.py), unless `env` is given. A result with an `error` (the
    initiator's exit status 3: RDMA not proven) is returned, not raised: the caller reports it."""
    tgt, ini = fab.endpoint("d0e0"), fab.endpoint("p0e0")
    tn, inn = tgt.nic("cnic"), ini.nic("cnic")
    py = [sys.executable, "-m", "testbed.calibrate.benches.transport_nixl"]
    rdma = "rdma" in args
    if rdma:
        from dualpath.transport.rdma import counters_delta, not_proven_message, preload_env, prove, read_counters

        if env is None:
            env = preload_env()
        # read here, in the testbed's own namespace: from inside an engine's the rxe
        # hw_counters come back empty (measured in the VM), which would prove nothing
        before = read_counters()
    target = subprocess.Popen(ns_argv(tgt.name, [*py, "--role", "target", "--iface", tn.dev, "--bind-ip", tn.ip,
                                                 "--max-time", str(int(timeout_s)), *args]),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO, env=env)
    try:
        p = subprocess.run(ns_argv(ini.name, [*py, "--role", "initiator", "--iface", inn.dev, "--peer-ip", tn.ip,
                                              *args]), capture_output=True, text=True, timeout=timeout_s,
                           cwd=REPO, env=env)
        if p.returncode not in (0, 3):
            tail = (p.stdout.strip().splitlines() or p.stderr.strip().splitlines() or [f"exit {p.returncode}"])
            raise RuntimeError(f"transport benchmark initiator failed (exit {p.returncode}): {tail[-1][-600:]}")
    finally:
        try:
            target.wait(timeout=10)
        except subprocess.TimeoutExpired:
            target.kill()
            target.wait()
    res = _json_tail(p.stdout)
    if rdma and "error" not in res:  # proof of transport, not configuration
        moved = res.get("bytes_moved") or {}
        # WRITE data leaves the initiator's device, READ data the target's
        sent = {fab.rxe_of(inn): moved.get("WRITE", 0)}
        sent[fab.rxe_of(tn)] = sent.get(fab.rxe_of(tn), 0) + moved.get("READ", 0)
        res["rdma"] = prove(counters_delta(read_counters(), before), sent, fab.rdma_mtu())
        if not res["rdma"]["rdma_proven"]:
            res["error"] = f"RdmaNotProvenError: {not_proven_message(res['rdma'], 'the transport benchmark')}"
    return res


def _shape(fab: Fabric, nics: list[Nic], rate_bps: int) -> None:
    """Shape both ends of `nics` at `rate_bps` (the topology's classes and MTU)."""
    for n in nics:
        classes = fab.qos and n.kind in ("cnic", "host_port")
        shape = lambda dev: htb_batch(NicShape(dev, rate_bps, classes, fab.topo.spec.mtu))  # noqa: E731
        run(["tc", "-force", "-batch", "-"], ns=n.ns, check=False, stdin=unshape_batch(n.dev))
        run(["tc", "-batch", "-"], ns=n.ns, stdin=shape(n.dev))
        run(["tc", "-force", "-batch", "-"], check=False, stdin=unshape_batch(n.bridge_dev))
        run(["tc", "-batch", "-"], stdin=shape(n.bridge_dev))


_BW_RE = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", re.M)


def perftest(fab: Fabric, tool: str, size: int, seconds: float, tclass: int) -> dict[str, Any]:
    """`tool` (ib_read_bw or ib_write_bw) between the rxe devices of d0e0 (server) and p0e0
    (client), on the IPv4 RoCEv2 GID (so u32 sees the DS field), one QP, `size`-byte messages.
    READ: the client reads from the server (data d0e0 -> p0e0), like NIXL's READ here; WRITE:
    p0e0 -> d0e0. Returns Gbit/s (perftest's BW average) and the rxe counters it moved."""
    from dualpath.transport.rdma import counters_delta, ipv4_gid_index, read_counters

    tgt, ini = fab.endpoint("d0e0"), fab.endpoint("p0e0")
    tn, inn = tgt.nic("cnic"), ini.nic("cnic")
    tdev, idev = fab.rxe_of(tn), fab.rxe_of(inn)
    common = ["-F", "-q", "1", "-s", str(size), "-D", str(int(seconds)), "--report_gbits", f"--tclass={tclass}"]
    before = read_counters()
    srv = subprocess.Popen(ns_argv(tgt.name, [tool, "-d", tdev, "-x", str(ipv4_gid_index(tdev)), *common]),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, deadline = "", time.monotonic() + 20
        while True:  # the server listens on TCP 18515 for the exchange; retry until it does
            time.sleep(1.0)
            p = subprocess.run(ns_argv(ini.name, [tool, "-d", idev, "-x", str(ipv4_gid_index(idev)), *common, tn.ip]),
                               capture_output=True, text=True, timeout=seconds + 60)
            out = p.stdout + p.stderr
            if p.returncode == 0 or time.monotonic() > deadline or srv.poll() is not None:
                break
        if p.returncode != 0:
            raise RuntimeError(f"{tool} failed (exit {p.returncode}): {' | '.join(out.strip().splitlines()[-3:])}")
    finally:
        try:
            srv.wait(timeout=seconds + 30)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()
    m = _BW_RE.findall(out)
    if not m:
        raise RuntimeError(f"{tool}: no result line in: {out[-300:]!r}")
    nbytes, iters, peak, avg, mpps = m[-1]
    delta = counters_delta(read_counters(), before)
    return {"tool": tool, "bytes_per_msg": int(nbytes), "iterations": int(iters), "Gbitps": float(avg),
            "GBps": float(avg) / 8, "seconds": seconds, "tclass": tclass,
            "rxe_sent_pkts": {d: c.get("sent_pkts", 0) for d, c in delta.items() if d in (tdev, idev)}}


def _rdma_leg(fab: Fabric, label: str, rounds: int, size: int, nixl_args: list[str],
              progress: Callable[[str], None]) -> dict[str, Any]:
    """Interleaved rounds of perftest and NIXL on the same link; ratios are per-round medians."""
    import statistics

    from dualpath.traffic_classes import KV as _KV

    out: dict[str, Any] = {"rounds": rounds, "size": size}
    perf = {"READ": [], "WRITE": []}
    nixl: list[dict] = []
    for i in range(rounds):
        progress(f"    {label}: round {i + 1}/{rounds}: ib_read_bw, ib_write_bw, NIXL READ/WRITE")
        for op, tool in (("READ", "ib_read_bw"), ("WRITE", "ib_write_bw")):
            perf[op].append(perftest(fab, tool, size, 3, _KV.tos_byte))
        nixl.append(_transport_pair(fab, ["--transport", "rdma", "--size", str(size), *nixl_args], 600))
        if "error" in nixl[-1]:
            break
    out["perftest"] = perf
    out["nixl"] = nixl
    errors = [r["error"] for r in nixl if "error" in r]
    if errors:
        out["error"] = errors[0]
    out["rdma_proven"] = not errors and all(r.get("rdma", {}).get("rdma_proven") for r in nixl)
    out["rxe_sent_pkts"] = sum(r.get("rdma", {}).get("rxe_sent_pkts", 0) for r in nixl)
    for op in ("READ", "WRITE"):
        mine = [r[f"{op}_median_GBps"] for r in nixl if f"{op}_median_GBps" in r]
        ref = [p["GBps"] for p in perf[op][:len(mine)]]
        out[f"{op}_median_GBps"] = statistics.median(mine) if mine else None
        out[f"perftest_{op}_median_GBps"] = statistics.median(ref) if ref else None
        ratios = [a / b for a, b in zip(mine, ref) if b]
        out[f"{op}_over_perftest_median"] = round(statistics.median(ratios), 4) if ratios else None
        out[f"{op}_over_perftest_all"] = [round(x, 4) for x in ratios]
    if nixl and "submission" in nixl[-1]:
        out["submission"] = nixl[-1]["submission"]
    cpu = [r["machine_cpu_s_per_GB"] for r in nixl if "machine_cpu_s_per_GB" in r]
    if cpu:
        out["machine_cpu_s_per_GB"] = cpu[-1]
    return out


def bench_transport_rdma(fab: Fabric, progress: Callable[[str], None] = print,
                         shaped_bps: int = RDMA_SHAPED_BPS) -> dict[str, Any]:
    """NIXL over rxe against perftest on the same link, unshaped and shaped; posting cost
    batched vs one by one; HTB class bytes; every leg proven by the rxe counters."""
    cn = [fab.endpoint("p0e0").nic("cnic"), fab.endpoint("d0e0").nic("cnic")]
    res: dict[str, Any] = {"transport": "rdma", "link": f"{cn[0].dev} -> {cn[1].dev}",
                           "rxe": {n.dev: fab.rxe_of(n) for n in cn}, "rdma_mtu": fab.rdma_mtu(),
                           "shaped_rate_bps": shaped_bps, "cnic_rate_bps": cn[0].rate_bps}
    common = ["--reps", "3", "--ndesc", "1", "--rounds", "1"]
    progress("  transport over rxe, unshaped veth ...")
    _unshape(cn)
    try:
        res["unshaped"] = _rdma_leg(fab, "unshaped", 2, 16 << 20, [*common, "--sub-ndesc", "256"], progress)
        progress(f"  transport over rxe, shaped at {shaped_bps / 1e6:g} Mbit/s ...")
        _shape(fab, cn, shaped_bps)
        res["shaped"] = _rdma_leg(fab, "shaped", 2, 4 << 20, [*common, "--sub-ndesc", "0"], progress)
    finally:
        fab.apply_shaping(fab.qos)
    progress("  transport bytes by HTB class (a byte-exact READ/WRITE check over rxe) ...")
    before = {c.name: class_bytes(cn[0].bridge_dev).get(class_for(True, c), 0) for c in (KV, MODEL)}
    res["check"] = _transport_pair(fab, ["--transport", "rdma", "--mode", "check", "--size", str(8 << 20)], 300)
    after = {c.name: class_bytes(cn[0].bridge_dev).get(class_for(True, c), 0) for c in (KV, MODEL)}
    res["class_bytes_into_initiator"] = {k: after[k] - before[k] for k in after}
    legs = [res["unshaped"], res["shaped"], {"rdma_proven": res["check"].get("rdma", {}).get("rdma_proven", False),
                                             "error": res["check"].get("error")}]
    res["rdma_proven"] = all(leg["rdma_proven"] for leg in legs)
    res["rxe_sent_pkts"] = (res["unshaped"]["rxe_sent_pkts"] + res["shaped"]["rxe_sent_pkts"]
                            + res["check"].get("rdma", {}).get("rxe_sent_pkts", 0))
    errs = [leg.get("error") for leg in legs if leg.get("error")]
    if errs:
        res["error"] = errs[0]
    for op in ("READ", "WRITE"):
        res[f"{op.lower()}_over_perftest"] = res["shaped"][f"{op}_over_perftest_median"]
        res[f"{op.lower()}_over_perftest_unshaped"] = res["unshaped"][f"{op}_over_perftest_median"]
    return res


def bench_transport(fab: Fabric, progress: Callable[[str], None] = print) -> dict[str, Any]:
    if fab.transport == "rdma":
        return bench_transport_rdma(fab, progress)
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
    from testbed.calibrate.benches.store_fio import bench_store_vs_fio

    store_ep = next(e for e in fab.endpoints if e.kind == "storage")
    node = fab.endpoint("p0")
    snic, st = node.nic("snic"), store_ep.nic("storage_nic")
    res: dict[str, Any] = {"snic_rate_bps": snic.rate_bps}
    progress("  store through the shaped SNIC vs iperf3 on it ...")
    sp = ServerProcess(scratch / "store", 2 << 30, listen=f"{st.ip}:7001", wrap=lambda argv: ns_argv(store_ep.name, argv),
                       log_path=scratch / "store.log")
    sp.start()
    try:
        ratios, store_gbps, iperf_gbps = [], [], []
        for i in range(3):  # interleaved: both sides of each ratio see the same machine
            ip = flow(store_ep.name, node.name, snic.ip, 5301, 3.0)
            out = run([sys.executable, "-m", "testbed.cluster.store_probe", "--store", sp.address_str, "--blocks", "96",
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
