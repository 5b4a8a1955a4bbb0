"""`dualpath bench transport --transport mooncake`: Mooncake's Transfer Engine across the fabric,
against iperf3 on the same shaped link, in the kv class.

Between two engine namespaces (target in d0e0, initiator in p0e0) over the CNICs shaped at the
topology's rate, Mooncake's TCP transport (the wheel `mooncake-transfer-engine-non-cuda`; its
handshake in P2PHANDSHAKE mode, so no metadata server) READs and WRITEs one registered buffer,
byte-exact, and iperf3 runs between the same two namespaces. Every process runs in the kv class:
its group marks each connection it opens (`dualpath exec --class`, testbed.fabric.access.class_argv), since
Mooncake picks its own ports and the kv port range cannot reach them. Rounds interleave iperf3 and
the transfers, so that a busy machine disturbs both sides of each ratio alike; the figures are the
per-round ratios' medians. Mooncake's own `transfer_engine_bench` runs across the same two
namespaces beside them.

    python -m testbed.calibrate.benches.transport_mooncake --role target --ip 10.0.0.2 --size N
    python -m testbed.calibrate.benches.transport_mooncake --role initiator --ip 10.0.0.1 --session S \\
        --remote-addr A --size N --reps R
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dualpath.transport.mooncake import WHEEL, MissingMooncake  # noqa: F401 (the CLI catches it here)
from testbed.calibrate.benches.peer import pattern

ROUNDS = 3
REPS = 3
IPERF_SECONDS = 3.0
IPERF_PORT = 5233
TRANSFER_S = 1.0  # each transfer lasts about this long at the shaped rate
BENCH_SECONDS = 4  # transfer_engine_bench's --duration
HELLO_TIMEOUT_S = 60.0  # the target's engine start and memory registration
CLASS = "kv"


def need_mooncake() -> Path:
    """The wheel's folder, or MissingMooncake naming what to install."""
    from dualpath.transport.mooncake import need_mooncake as need

    return Path(need())


def _engine(ip: str, device: str = ""):
    """Mooncake's engine on `ip`: its TCP transport, or with `device` (an rxe device) its RDMA
    transport, on the device's IPv4 RoCEv2 GID with the kv class's DSCP in every packet."""
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake logs every handshake at INFO
    if device:
        from dualpath.traffic_classes import KV
        from dualpath.transport.rdma import ipv4_gid_index

        os.environ["MC_GID_INDEX"] = str(ipv4_gid_index(device))  # read when the module loads
        os.environ["MC_IB_TC"] = str(KV.tos_byte)
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    if te.initialize(ip, "P2PHANDSHAKE", "rdma" if device else "tcp", device) != 0:
        raise RuntimeError(f"Mooncake's transfer engine did not start on {ip}"
                           + (f" with RDMA device {device}" if device else ""))
    return te


def run_target(ip: str, size: int, max_s: float, device: str = "") -> None:
    """Register a patterned buffer, say where it is (one JSON line), serve until stdin closes."""
    te = _engine(ip, device)
    buf = pattern(size, 1)
    if te.register_memory(buf.ctypes.data, size) != 0:
        raise RuntimeError("register_memory failed")
    print(json.dumps({"session": f"{ip}:{te.get_rpc_port()}", "addr": buf.ctypes.data,
                      "sha256": hashlib.sha256(buf.tobytes()).hexdigest()}), flush=True)
    select.select([sys.stdin], [], [], max_s)  # the harness closes stdin when it is done


def run_initiator(ip: str, session: str, remote: int, size: int, reps: int, want: str,
                  device: str = "") -> dict[str, Any]:
    """READ the target's buffer (byte-exact against its digest), then `reps` timed READs and WRITEs."""
    te = _engine(ip, device)
    buf = np.zeros(size, np.uint8)
    if te.register_memory(buf.ctypes.data, size) != 0:
        raise RuntimeError("register_memory failed")
    out: dict[str, Any] = {}
    if te.transfer_sync_read(session, buf.ctypes.data, remote, size) != 0:
        raise RuntimeError(f"READ from {session} failed")
    out["read_exact"] = hashlib.sha256(buf.tobytes()).hexdigest() == want
    for op in ("READ", "WRITE"):
        call = te.transfer_sync_read if op == "READ" else te.transfer_sync_write
        rates = []
        for _ in range(reps):
            t0 = time.perf_counter()
            if call(session, buf.ctypes.data, remote, size) != 0:
                raise RuntimeError(f"{op} with {session} failed")
            rates.append(size / (time.perf_counter() - t0))
        out[op] = rates
    return out


# ---- the harness -------------------------------------------------------------------------------
def _pair(fab, size: int, reps: int, rdma: bool = False) -> dict[str, Any]:
    tgt, ini = fab.endpoint("d0e0"), fab.endpoint("p0e0")
    py = [sys.executable, "-m", "testbed.calibrate.benches.transport_mooncake"]

    def dev(ep) -> list[str]:
        return ["--device", fab.rxe[ep.nic("cnic").dev]] if rdma else []

    target = subprocess.Popen(_in_class(tgt.name, [*py, "--role", "target", "--ip", tgt.nic("cnic").ip,
                                                   "--size", str(size), *dev(tgt)]),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ready, _, _ = select.select([target.stdout], [], [], HELLO_TIMEOUT_S)  # bounded: a stuck start fails
        hello = json.loads(target.stdout.readline() or "{}") if ready else {}
        if "session" not in hello:
            raise RuntimeError("the Mooncake target did not start (see `dualpath exec d0e0 --python -- -m "
                               "testbed.calibrate.benches.transport_mooncake --role target ...`)")
        p = subprocess.run(_in_class(ini.name, [*py, "--role", "initiator", "--ip", ini.nic("cnic").ip,
                                                "--session", hello["session"], "--remote-addr", str(hello["addr"]),
                                                "--size", str(size), "--reps", str(reps), "--sha256", hello["sha256"],
                                                *dev(ini)]),
                           capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            raise RuntimeError(f"the Mooncake initiator failed: {(p.stderr or p.stdout).strip()[-300:]}")
        return json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        target.stdin.close()
        try:
            target.wait(timeout=10)
        except subprocess.TimeoutExpired:
            target.kill()
            target.wait()


def _iperf(fab) -> float:
    from testbed.fabric.access import class_argv
    from testbed.fabric.iperf import IperfServer, client_argv, parse_client
    from testbed.fabric.shell import run

    srv, cli = fab.endpoint("d0e0"), fab.endpoint("p0e0")
    with IperfServer(srv.name, srv.nic("cnic").ip, IPERF_PORT):
        out = run(class_argv(client_argv(srv.nic("cnic").ip, IPERF_PORT, IPERF_SECONDS), CLASS), ns=cli.name,
                  timeout=IPERF_SECONDS + 15)
    return parse_client(out).goodput_bps / 8


def _class_bytes(fab) -> dict[str, dict[str, int]]:
    from emulators.nic import CLASS_IDS
    from testbed.fabric.counters import class_bytes

    out = {}
    for name in ("p0e0", "d0e0"):
        nic = fab.endpoint(name).nic("cnic")
        got = class_bytes(nic.dev, nic.ns)
        out[name] = {c: got.get(cid, 0) for c, cid in CLASS_IDS.items()}
    return out


def engine_bench(fab, wheel: Path, scratch: Path) -> dict[str, Any]:
    """Mooncake's own transfer_engine_bench, target in d0e0 and initiator in p0e0, both in the kv
    class: its reported throughput for READ and WRITE."""
    exe = wheel / "transfer_engine_bench"
    tgt, ini = fab.endpoint("d0e0"), fab.endpoint("p0e0")
    common = ["--metadata_server=P2PHANDSHAKE", "--protocol=tcp", "--buffer_size=67108864",
              "--block_size=1048576", "--batch_size=4", "--threads=1", "--report_unit=MB"]
    out: dict[str, Any] = {}
    for op in ("read", "write"):
        log = scratch / f"dpt-teb-target-{op}.log"
        with open(log, "w") as lf:
            target = subprocess.Popen(_in_class(tgt.name, [str(exe), "--mode=target",
                                                           f"--local_server_name={tgt.nic('cnic').ip}", *common]),
                                      stdout=lf, stderr=subprocess.STDOUT)
        try:
            segment = _segment_of(log, target)  # P2P handshake: the target picks its port and logs it
            p = subprocess.run(_in_class(ini.name, [str(exe), "--mode=initiator", f"--segment_id={segment}",
                                                    f"--local_server_name={ini.nic('cnic').ip}", f"--operation={op}",
                                                    f"--duration={BENCH_SECONDS}", *common]),
                               capture_output=True, text=True, timeout=BENCH_SECONDS + 60)
            text = p.stdout + p.stderr
            m = re.search(r"throughput\s+([\d.]+)\s*MB/s", text, re.I)
            out[op] = ({"bytes_per_s": float(m.group(1)) * 1e6} if m and p.returncode == 0
                       else {"error": f"exit {p.returncode}: {' '.join(text.split())[-200:]}"})
        finally:
            target.kill()
            target.wait()
            log.unlink(missing_ok=True)
    return out


def _in_class(ns: str, argv: list[str]) -> list[str]:
    from testbed.fabric.access import class_argv
    from testbed.fabric.shell import ns_argv

    return class_argv(ns_argv(ns, argv), CLASS)


def _segment_of(log: Path, proc: subprocess.Popen, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(r"P2P handshake, listening on (\S+:\d+)", log.read_text(errors="replace"))
        if m:
            return m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"transfer_engine_bench's target did not say where it listens: "
                       f"{' '.join(log.read_text(errors='replace').split())[-200:]}")


def bench_transport_mooncake(fab, scratch: Path, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Mooncake READ and WRITE against iperf3 on the shaped CNIC, in interleaved rounds."""
    from testbed.fabric.access import enable_class_marking

    wheel = need_mooncake()
    for name in ("p0e0", "d0e0"):
        enable_class_marking(fab.endpoint(name).name)
    rate = fab.endpoint("p0e0").nic("cnic").rate_bps
    size = max(1 << 20, int(rate / 8 * TRANSFER_S)) // 4096 * 4096
    res: dict[str, Any] = {"transport": "mooncake", "wheel": WHEEL, "class": CLASS, "cnic_rate_bps": rate,
                           "bytes_per_transfer": size, "rounds": ROUNDS, "reps": REPS}
    rounds = []
    before = _class_bytes(fab)
    for i in range(ROUNDS):
        ip = _iperf(fab)
        mc = _pair(fab, size, REPS)
        rounds.append({"iperf3_bytes_per_s": ip, **{op: mc[op] for op in ("READ", "WRITE")},
                       "read_exact": mc["read_exact"]})
        progress(f"  round {i + 1}/{ROUNDS}: iperf3 {ip * 8 / 1e6:.1f} Mbit/s, Mooncake READ "
                 f"{statistics.median(mc['READ']) * 8 / 1e6:.1f}, WRITE {statistics.median(mc['WRITE']) * 8 / 1e6:.1f}")
    after = _class_bytes(fab)
    res["rounds_detail"] = rounds
    res["shaped"] = {f"{op}_over_iperf3_median": round(statistics.median(
        statistics.median(r[op]) / r["iperf3_bytes_per_s"] for r in rounds), 4) for op in ("READ", "WRITE")}
    res["byte_exact"] = all(r["read_exact"] for r in rounds)
    res["class_bytes_sent"] = {n: {c: after[n][c] - before[n][c] for c in after[n]} for n in after}
    moved = ROUNDS * ((REPS + 1) * size + REPS * size)  # READs (and the check) leave d0e0, WRITEs p0e0
    sent = res["class_bytes_sent"]
    res["in_kv_class"] = (sent["d0e0"]["kv"] + sent["p0e0"]["kv"] >= moved
                          and sent["d0e0"]["model"] + sent["p0e0"]["model"] < 0.02 * moved)
    progress("  Mooncake's transfer_engine_bench across the same namespaces ...")
    before = _class_bytes(fab)
    res["transfer_engine_bench"] = engine_bench(fab, wheel, scratch)
    after = _class_bytes(fab)
    res["transfer_engine_bench"]["class_bytes_sent"] = {n: {c: after[n][c] - before[n][c] for c in after[n]}
                                                        for n in after}
    for op in ("read", "write"):
        leg = res["transfer_engine_bench"][op]
        if "bytes_per_s" in leg:
            leg["over_iperf3_median"] = round(leg["bytes_per_s"] / statistics.median(
                r["iperf3_bytes_per_s"] for r in rounds), 4)
    return res


def rdma_check(fab, progress: Callable[[str], None] = print, size: int = 8 << 20) -> dict[str, Any]:
    """Mooncake's RDMA transport over the fabric's rxe devices (a fabric brought up with transport
    rdma, as `dualpath check --rdma` does): a byte-exact READ, then a READ and a WRITE, between d0e0
    and p0e0, proven by the rxe devices' hw_counters like NIXL's check."""
    from dualpath.transport.rdma import counters_delta, prove, read_counters

    try:
        need_mooncake()
    except MissingMooncake as e:
        return {"skipped": str(e)}
    from dualpath.traffic_classes import KV, MODEL
    from emulators.nic import class_for
    from testbed.fabric.counters import class_bytes

    into = fab.endpoint("p0e0").nic("cnic").bridge_dev  # the READ responses' way into the initiator

    def by_class() -> dict[str, int]:
        return {c.name: class_bytes(into).get(class_for(True, c), 0) for c in (KV, MODEL)}

    progress("  Mooncake READ/WRITE over rxe between p0e0 and d0e0 (its RDMA transport) ...")
    before, classes0 = read_counters(), by_class()
    try:
        res = _pair(fab, size, 1, rdma=True)
    except RuntimeError as e:
        return {"bytes_exact": False, "rdma_proven": False, "error": " ".join(str(e).split())[:600]}
    delta, classes = counters_delta(read_counters(), before), by_class()
    tgt, ini = (fab.rxe[fab.endpoint(n).nic("cnic").dev] for n in ("d0e0", "p0e0"))
    proof = prove(delta, {tgt: 2 * size, ini: size}, fab.rdma_mtu())  # READ responses leave d0e0, the WRITE p0e0
    return {"bytes_exact": bool(res.get("read_exact")), "rdma_proven": bool(proof["rdma_proven"]) and bool(res.get("read_exact")),
            "bytes": 3 * size, "class_bytes_into_initiator": {k: classes[k] - classes0[k] for k in classes},
            "rdma": proof}


def lines(res: dict[str, Any]) -> list[str]:
    s = res["shaped"]
    out = [f"Mooncake transfer engine (TCP, {res['wheel']}) between p0e0 and d0e0 over CNICs shaped at "
           f"{res['cnic_rate_bps'] / 1e6:g} Mbit/s, {res['bytes_per_transfer'] / 1e6:.1f} MB per transfer, "
           f"{res['rounds']} rounds x {res['reps']} against iperf3 on the same link, all in the {res['class']} class",
           f"  READ  {s['READ_over_iperf3_median']:.3f} of iperf3 (median of the rounds' ratios)",
           f"  WRITE {s['WRITE_over_iperf3_median']:.3f} of iperf3",
           f"  byte-exact: {res['byte_exact']}; every byte in the kv class: {res['in_kv_class']} "
           f"(sent, by class: {res['class_bytes_sent']})"]
    for op in ("read", "write"):
        leg = res["transfer_engine_bench"][op]
        out.append(f"  transfer_engine_bench {op}: " + (f"{leg['bytes_per_s'] * 8 / 1e6:.1f} Mbit/s = "
                                                         f"{leg['over_iperf3_median']:.3f} of iperf3"
                                                         if "bytes_per_s" in leg else leg["error"]))
    out.append(f"  transfer_engine_bench's bytes sent, by class: {res['transfer_engine_bench']['class_bytes_sent']}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.calibrate.benches.transport_mooncake", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["target", "initiator"], required=True)
    ap.add_argument("--ip", required=True, help="this side's CNIC address")
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--session", help="initiator: the target's ip:port")
    ap.add_argument("--remote-addr", type=int, help="initiator: the target's buffer address")
    ap.add_argument("--sha256", default="", help="initiator: the target buffer's digest")
    ap.add_argument("--reps", type=int, default=REPS)
    ap.add_argument("--max-s", type=float, default=600.0, help="target: lifetime bound")
    ap.add_argument("--device", default="", help="an rxe device: Mooncake's RDMA transport on it (default: TCP)")
    a = ap.parse_args(argv)
    if a.role == "target":
        run_target(a.ip, a.size, a.max_s, a.device)
        return 0
    if not a.session or a.remote_addr is None:
        ap.error("the initiator needs --session and --remote-addr")
    print(json.dumps(run_initiator(a.ip, a.session, a.remote_addr, a.size, a.reps, a.sha256, a.device)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
