"""`dualpath bench ucx-perftest`: UCX's own benchmark across the fabric, against iperf3 on the same
shaped link, in each traffic class.

Between two engine namespaces (server in d0e0, client in p0e0), over the CNICs shaped at the
topology's rate: `ucx_perftest` (Debian's ucx-utils, its own UCX build) runs tag_bw (two-sided)
and ucp_put_bw and ucp_get (one-sided RMA) over UCX's TCP transport on the CNIC, and iperf3 runs
between the same two namespaces; every program runs in the class asked for (`--class`: its group
marks every packet, testbed.fabric.access.class_argv), kv and then model. The HTB class counters of the
sending CNIC (p0e0's; d0e0's for get, whose responder sends) say which class carried the bytes.
Figures are ratios measured side by side in one run: perftest's bandwidth over iperf3's goodput on
the same link in the same class.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from typing import Any, Callable

from dualpath.traffic_classes import CLASS_GIDS
from dualpath.transport.env import build_ucx_env
from emulators.nic import CLASS_IDS
from testbed.fabric.access import class_argv, enable_class_marking
from testbed.fabric.counters import class_bytes
from testbed.fabric.network import Fabric
from testbed.fabric.iperf import IperfServer, client_argv, parse_client
from testbed.fabric.shell import ns_argv, run

TESTS = {"tag_bw": "client", "ucp_put_bw": "client", "ucp_get": "server"}  # test -> which side sends the data
MSG_BYTES = 1 << 20
SECONDS = 3.0  # per measurement
PORT = 13337  # ucx_perftest's control port (its default)
IPERF_PORT = 5231
MB = 1 << 20  # ucx_perftest's MB/s


class MissingTool(RuntimeError):
    pass


def need_tool() -> str:
    path = shutil.which("ucx_perftest")
    if path is None:
        raise MissingTool("bench ucx-perftest needs ucx_perftest, from Debian's ucx-utils; fix: apt-get install "
                          "ucx-utils (scripts/bootstrap.sh installs it)")
    return path


def parse_final(out: str) -> float:
    """Bandwidth in bytes/s from ucx_perftest's final row (with -f the only row of numbers, without
    it the one labelled `Final:`): iterations, three overheads, then average and overall MB/s."""
    for line in reversed(out.splitlines()):
        fields = line.strip().removeprefix("Final:").split()
        # a latency column may read inf (a percentile over too few samples): only bandwidth must be a number
        if len(fields) >= 6 and all(re.fullmatch(r"[-+]?(?:\d+(?:\.\d+)?|inf|nan)", f) for f in fields) \
                and re.fullmatch(r"\d+(?:\.\d+)?", fields[5]):
            return float(fields[5]) * MB
    raise RuntimeError(f"ucx_perftest printed no final row: {out[-300:]!r}")


def _env(iface: str, cls: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(build_ucx_env(iface, cls, "tcp", base=env))
    return env


def perftest(fab: Fabric, test: str, cls: str, iters: int, msg_bytes: int = MSG_BYTES) -> dict[str, Any]:
    """One ucx_perftest run in `cls`: its bandwidth and the class bytes its sender's CNIC sent."""
    srv, cli = fab.endpoint("d0e0"), fab.endpoint("p0e0")
    sn, cn = srv.nic("cnic"), cli.nic("cnic")
    sender = cn if TESTS[test] == "client" else sn
    before = class_bytes(sender.dev, sender.ns)
    server = subprocess.Popen(class_argv(ns_argv(srv.name, ["ucx_perftest", "-p", str(PORT)]), cls),
                              env=_env(sn.dev, cls), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)  # the server listens on its control port
        argv = ["ucx_perftest", sn.ip, "-p", str(PORT), "-t", test, "-s", str(msg_bytes), "-n", str(iters),
                "-w", "2", "-f"]
        p = subprocess.run(class_argv(ns_argv(cli.name, argv), cls), env=_env(cn.dev, cls), capture_output=True,
                           text=True, timeout=SECONDS * 10 + 30)
        if p.returncode != 0:
            raise RuntimeError(f"ucx_perftest -t {test}: exit {p.returncode}: {(p.stderr or p.stdout).strip()[-200:]}")
        bw = parse_final(p.stdout)
    finally:
        if server.poll() is None:
            server.kill()
        server.wait(timeout=5)
    moved = {c: class_bytes(sender.dev, sender.ns).get(cid, 0) - before.get(cid, 0) for c, cid in CLASS_IDS.items()}
    return {"test": test, "class": cls, "bytes_per_s": bw, "payload_bytes": (iters + 2) * msg_bytes,
            "sender": sender.dev, "class_bytes": moved}


def iperf(fab: Fabric, cls: str) -> dict[str, Any]:
    """iperf3 from p0e0 to d0e0 on the same link, its sender in `cls`."""
    srv, cli = fab.endpoint("d0e0"), fab.endpoint("p0e0")
    sn, cn = srv.nic("cnic"), cli.nic("cnic")
    before = class_bytes(cn.dev, cn.ns)
    with IperfServer(srv.name, sn.ip, IPERF_PORT):
        out = run(class_argv(client_argv(sn.ip, IPERF_PORT, SECONDS), cls), ns=cli.name, timeout=SECONDS + 15)
    r = parse_client(out)
    moved = {c: class_bytes(cn.dev, cn.ns).get(cid, 0) - before.get(cid, 0) for c, cid in CLASS_IDS.items()}
    return {"class": cls, "bytes_per_s": r.goodput_bps / 8, "payload_bytes": r.bytes, "class_bytes": moved}


def in_class(leg: dict[str, Any]) -> bool:
    """Its bytes went in the class asked for: at least the payload there, and the other class
    carried less than 2 % of it (control, ACKs of the peer's own)."""
    cls = leg["class"]
    other = next(c for c in CLASS_IDS if c != cls)
    return leg["class_bytes"][cls] >= leg["payload_bytes"] and leg["class_bytes"][other] < 0.02 * leg["payload_bytes"]


def bench_ucx_perftest(fab: Fabric, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every test in both classes beside iperf3 in the same class: summary.json's content."""
    need_tool()
    for name in ("p0e0", "d0e0"):
        enable_class_marking(fab.endpoint(name).name)
    rate = fab.endpoint("p0e0").nic("cnic").rate_bps
    iters = max(8, int(SECONDS * rate / 8 / MSG_BYTES))
    out: dict[str, Any] = {"cnic_bps": rate, "message_bytes": MSG_BYTES, "iterations": iters,
                           "class_gids": dict(CLASS_GIDS), "classes": {}}
    for cls in CLASS_IDS:
        ref = iperf(fab, cls)
        progress(f"  {cls}: iperf3 {ref['bytes_per_s'] * 8 / 1e6:.1f} Mbit/s")
        legs = {}
        for test in TESTS:
            leg = perftest(fab, test, cls, iters)
            leg["over_iperf3"] = round(leg["bytes_per_s"] / ref["bytes_per_s"], 4)
            leg["in_class"] = in_class(leg)
            legs[test] = leg
            progress(f"  {cls}: ucx_perftest {test} {leg['bytes_per_s'] * 8 / 1e6:.1f} Mbit/s = "
                     f"{leg['over_iperf3']:.3f} of iperf3; its bytes in the {cls} class: {leg['in_class']}")
        out["classes"][cls] = {"iperf3": {**ref, "in_class": in_class(ref)}, "tests": legs}
    out["put_by_message_size"] = put_sweep(fab, rate, out["classes"]["kv"]["iperf3"]["bytes_per_s"],
                                           progress)
    ratios = [t["over_iperf3"] for c in out["classes"].values() for t in c["tests"].values()]
    out["min_over_iperf3"] = min(ratios)
    out["all_in_class"] = all(t["in_class"] for c in out["classes"].values()
                              for t in [*c["tests"].values(), c["iperf3"]])
    return out


PUT_SIZES = (256 << 10, 1 << 20, 4 << 20)


def put_sweep(fab: Fabric, rate: float, iperf_bps: float, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """ucp_put_bw at several message sizes in the kv class: over UCX's TCP transport its share of
    iperf3 falls as messages grow (tag and get do not), which no one size shows."""
    out = []
    for size in PUT_SIZES:
        leg = perftest(fab, "ucp_put_bw", "kv", max(8, int(SECONDS * rate / 8 / size)), size)
        out.append({"message_bytes": size, "bytes_per_s": leg["bytes_per_s"],
                    "over_iperf3": round(leg["bytes_per_s"] / iperf_bps, 4), "in_class": in_class(leg)})
        progress(f"  kv: ucp_put_bw at {size >> 10} KiB messages: {out[-1]['over_iperf3']:.3f} of iperf3")
    return out


def lines(res: dict[str, Any]) -> list[str]:
    out = [f"ucx_perftest (Debian's ucx-utils) between p0e0 and d0e0 over CNICs shaped at "
           f"{res['cnic_bps'] / 1e6:g} Mbit/s, {res['message_bytes'] >> 20} MiB messages x {res['iterations']}; "
           f"iperf3 on the same link in the same class",
           f"{'class':<6} {'test':<11} {'Mbit/s':>8} {'of iperf3':>9} {'in class':>8}"]
    for cls, c in res["classes"].items():
        out.append(f"{cls:<6} {'iperf3':<11} {c['iperf3']['bytes_per_s'] * 8 / 1e6:8.1f} {'1':>9} "
                   f"{str(c['iperf3']['in_class']):>8}")
        for test, t in c["tests"].items():
            out.append(f"{cls:<6} {test:<11} {t['bytes_per_s'] * 8 / 1e6:8.1f} {t['over_iperf3']:9.3f} "
                       f"{str(t['in_class']):>8}")
    out.append(f"least ratio {res['min_over_iperf3']:.3f}; every leg's bytes in its class: {res['all_in_class']}")
    if res.get("put_by_message_size"):
        out.append("ucp_put_bw by message size (kv class): " + ", ".join(
            f"{x['message_bytes'] >> 10} KiB {x['over_iperf3']:.3f}" for x in res["put_by_message_size"])
                   + " of iperf3 (NIXL's WRITE, a UCX put too, gives 1.0 at 32 MiB: `bench transport`)")
    return out
