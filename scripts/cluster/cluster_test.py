"""make cluster-test: one topology over two servers, this machine and a QEMU guest of the project's
VM image (testbed/fabric/guest_server.py); results/cluster/<run-id>/summary.json.

    python scripts/cluster/cluster_test.py [--run-id ID] [--smp N] [--iperf-s S] [--trajectories N | --no-run]
                                           [--place d0=guest,s0=guest] [--modes basic,dualpath]

Each step is the command a user would type, run as a child process:

1. the guest boots with a tap NIC and serves SSH with a key made for the run;
2. `dualpath topo` and `dualpath cluster prepare` on topologies/1p1d-io.yaml with d0 placed in the
   guest (VXLAN tunnels: this machine's kernel has no ip_gre; MTU 8900 under the tap's 9000);
3. `dualpath up --detach`: this machine's namespaces, the guest's (over SSH), tunnels between the
   two servers' bridges; a ping and a bounded iperf3 from the guest's d0e0 to this machine's p0e0
   through both CNICs and the compute tunnel, with the bytes each counted; `dualpath down`.
   `--place s0=guest` puts the storage server in the guest instead: its store's folder is then on
   the guest's disk, every KV read crosses the storage tunnel, and the iperf3 goes from s0's
   storage NIC to p0's SNIC;
4. `dualpath run` through every mode, one trajectory (skipped with --no-run): d0's host agent and
   engines start in the guest over SSH, every process computes with the portable kernels
   (dualpath/model/numerics.py) and the guest's clock is aligned with this one's; tokens and KV
   verified bit-exact, every NIC's bytes against the paths. The guest runs under TCG, so the run
   is UNFAITHFUL by design (about 20 minutes on the 2-core dev machine: docs/cluster.md);
5. leftovers on both servers (0 expected);
6. `dualpath up --detach` again, SIGKILL of its runner (the conductor's process here), `dualpath
   clean TOPOLOGY`, and leftovers on both servers again.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from testbed.fabric.guest_server import GUEST_IP, TAP, GuestServer  # noqa: E402
from testbed.fabric.remote import run_on  # noqa: E402

CLI = [sys.executable, "-m", "testbed.cli"]
IPERF_PORT = 5301
MODES = "basic,layerwise,dualpath-rr,dualpath,dualpath-split,oracle"  # every mode


def cli(*args: str, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    print(f"$ dualpath {' '.join(args)}", flush=True)
    p = subprocess.run([*CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    for line in (p.stdout + p.stderr).strip().splitlines()[-40:]:
        print(f"  {line}", flush=True)
    return p


def cli_streamed(*args: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """cli() for a long command: its output (stdout and stderr together) is printed as it comes,
    so a run's progress shows; past `timeout` it is ended with SIGTERM (its own cleanup runs)."""
    print(f"$ dualpath {' '.join(args)}", flush=True)
    proc = subprocess.Popen([*CLI, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    timer = threading.Timer(timeout, proc.terminate)
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            print(f"  {line.rstrip()}", flush=True)
    finally:
        timer.cancel()
        proc.wait()
    text = "".join(lines)
    return subprocess.CompletedProcess(proc.args, proc.returncode, text, text)


def parse_place(text: str) -> dict[str, str]:
    """--place "d0=guest,s0=guest" -> {"d0": "guest", "s0": "guest"}; every unit named goes to the guest."""
    place = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        unit, _, server = item.partition("=")
        if server != "guest" or not unit:
            raise SystemExit(f"cluster-test: --place {item!r}: expected UNIT=guest (e.g. d0=guest or s0=guest)")
        place[unit] = server
    if not place:
        raise SystemExit("cluster-test: --place names no unit")
    return place


def write_topology(out: Path, guest: GuestServer, place: dict[str, str]) -> Path:
    raw = yaml.safe_load((REPO / "topologies" / "1p1d-io.yaml").read_text())
    # The guest has 6 GiB: d0's DRAM buffer and its engines' HBM are sized down to fit beside torch.
    raw.update(name="cluster-1p1d-io", mtu=8900, tunnel="vxlan",
               description=f"make cluster-test: {', '.join(place)} in a QEMU guest",
               dram_buffer_gib=1, hbm_gib_per_engine=0.25,
               servers=[{"name": "host", "address": "10.79.0.1", "nic_gbps": 10, "mtu": 9000},
                        guest.spec("guest", nic_gbps=10).model_dump(exclude_none=True)],
               place=place)
    path = out / "topology.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def local_leftovers() -> dict:
    from testbed.fabric.cleanup import find_leftovers

    left = find_leftovers()
    return {"count": sum(len(v) for v in vars(left).values()), "what": left.summary()}


def guest_leftovers(guest) -> dict:
    """What carries the prefix in the guest, found by the same code as here (processes included:
    a node process whose namespace went is still a leftover)."""
    code = ("import json; from testbed.fabric.cleanup import find_leftovers; l = find_leftovers(); "
            "print(json.dumps({'count': sum(len(v) for v in vars(l).values()), 'what': l.summary()}))")
    for _ in range(3):  # a connection `dualpath clean` just closed may refuse the first try
        p = run_on(guest, ["bash", "-c", f"cd {REPO} && {guest.python} -c \"{code}\""], timeout=300)
        try:
            return json.loads(p.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            time.sleep(2)
    return {"count": -1, "what": f"could not ask the guest: {p.stderr.strip()[-200:]}"}


def _sys_bytes(dev: str, what: str, ns: str | None = None) -> int:
    argv = (["ip", "netns", "exec", ns] if ns else []) + ["cat", f"/sys/class/net/{dev}/statistics/{what}"]
    return int(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)


def crossing(place: dict[str, str]) -> tuple[str, str, str, str]:
    """Which shaped pair the traffic step measures across the servers: (the guest's namespace, this
    machine's endpoint, its NIC, the tunnel): d0e0's CNIC to p0e0's over the compute tunnel when
    the guest holds d0, else s0's storage NIC to p0's SNIC over the storage tunnel."""
    if "d0" in place:
        return "dpt-d0e0", "dpt-p0e0", "cnic", "dpt-vc0-1"
    if "s0" in place:
        return "dpt-s0", "dpt-p0", "snic", "dpt-vs0-1"
    raise SystemExit(f"cluster-test: --place {','.join(place)}: the traffic step needs d0 or s0 in the guest")


def traffic(topo_path: Path, guest, iperf_s: int, place: dict[str, str]) -> dict:
    """A ping and an iperf3 from a namespace in the guest to one here (crossing()), with the bytes
    the receiving NIC, the tunnel and the tap counted."""
    from testbed.fabric.network import plan
    from testbed.topology import load_topology

    topo = load_topology(topo_path)
    eps = {e.name: e for e in plan(topo)}
    src_ns, dst_ep, dst_nic, tunnel = crossing(place)
    dst = eps[dst_ep].nic(dst_nic)
    ping = run_on(guest, ["ip", "netns", "exec", src_ns, "ping", "-c", "3", "-W", "3", dst.ip], timeout=60)
    counters = [("nic", dst.dev, dst.ns), ("tunnel", tunnel, None), ("tap", TAP, None)]
    before = {k: (_sys_bytes(d, "rx_bytes", ns), _sys_bytes(d, "rx_packets", ns)) for k, d, ns in counters}
    server = subprocess.Popen(["ip", "netns", "exec", dst.ns, "iperf3", "-s", "-1", "-p", str(IPERF_PORT)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)
    client = run_on(guest, ["ip", "netns", "exec", src_ns, "timeout", str(iperf_s + 30), "iperf3", "-c", dst.ip,
                            "-p", str(IPERF_PORT), "-t", str(iperf_s), "-J"], timeout=iperf_s + 60)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
    after = {k: (_sys_bytes(d, "rx_bytes", ns), _sys_bytes(d, "rx_packets", ns)) for k, d, ns in counters}
    got = {k: {"bytes": after[k][0] - before[k][0], "packets": after[k][1] - before[k][1]} for k in after}
    try:
        bps = json.loads(client.stdout)["end"]["sum_received"]["bits_per_second"]
    except (ValueError, KeyError):
        bps = None
    inner, outer = got["tunnel"], got["tap"]
    # A vxlan device counts a received packet without its inner Ethernet header (the stack pulled
    # it); a veth and the tap count whole frames.
    inner_frames = inner["bytes"] + 14 * inner["packets"]
    return {
        "from": src_ns, "to": f"{dst_ep}/{dst_nic}", "tunnel": tunnel,
        "ping_ok": ping.returncode == 0, "ping_last_line": (ping.stdout.strip().splitlines() or [""])[-1],
        "iperf3_bits_per_second": bps, "nic_rate_bps": dst.rate_bps,
        "iperf3_over_nic_rate": round(bps / dst.rate_bps, 4) if bps else None,
        "received": got,
        # the receiving NIC counts the frames the tunnel delivered (the tunnel adds nothing inside)
        "nic_over_tunnel_frames": round(got["nic"]["bytes"] / inner_frames, 6) if inner["packets"] else None,
        # the tap's outer frames less the tunnel's inner ones, per tunnelled packet (50 B expected;
        # the run's SSH traffic on the same tap adds a little)
        "tunnel_overhead_bytes_per_packet": round((outer["bytes"] - inner_frames) / inner["packets"], 2)
        if inner["packets"] else None,
    }


def up_state(topo_path: Path) -> dict | None:
    p = cli("up", str(topo_path), "--detach", "--json")
    try:
        return json.loads(p.stdout) if p.returncode == 0 else None
    except ValueError:
        return None


def run_modes(topo_path: Path, out: Path, trajectories: int, modes: str) -> dict:
    """`dualpath run` through the modes; per mode what the issue's checks read."""
    # the guest's processes run under TCG: every timeout that waits on them is scaled as in the VM
    p = cli_streamed("run", str(topo_path), "--modes", modes, "--trajectories", str(trajectories),
                     "--out", str(out / "run"), timeout=3600, env={"DPT_TIMEOUT_SCALE": "20"})
    runs = sorted((out / "run").glob("*/summary.json"))
    e = json.loads(runs[-1].read_text()) if runs else {}
    modes = {}
    for m, v in e.get("modes", {}).items():
        kv = v.get("kv_bytes_vs_expected") or {}
        modes[m] = {"verification": v.get("verification"), "faithful": v.get("faithful"),
                    "nic_bytes_ok": bool(kv) and kv.get("within") == kv.get("nics"),
                    "kv_bytes_vs_expected": {k: kv.get(k) for k in ("nics", "within")},
                    "nic_ratios": {r["nic"]: r["ratio"] for r in kv.get("per_nic", [])}}
    return {"exit": p.returncode, "summary": str(runs[-1].relative_to(REPO)) if runs else None,
            "error": next((ln for ln in p.stderr.splitlines() if ln.startswith("dualpath:")), None), "modes": modes}


def checks_of(summary: dict, modes: str | None) -> dict[str, bool]:
    """What the test asserts, by name, from its summary (`modes`: the run's, None without a run)."""
    traffic = summary.get("traffic", {})
    ran = summary.get("modes") or {}
    return {
        "prepare ready": summary["prepare"]["ok"],
        "fabric up across both servers": summary["fabric_up"],
        "ping through the tunnel": bool(traffic.get("ping_ok")),
        "receiving NIC's bytes = tunnel's frames within 2 %": abs((traffic.get("nic_over_tunnel_frames") or 0) - 1) <= 0.02,
        **({} if modes is None else {
            "every mode ran": bool(ran) and len(ran) == len(modes.split(",")),
            # the oracle moves no KV, so nothing of it is checked ("n/a (oracle moves no KV)")
            "every mode that moves KV bit-exact": bool(ran) and all(
                (m.get("verification") or {}).get("all_match") for name, m in ran.items() if name != "oracle"),
            "every NIC's bytes within 2 % of the paths": bool(ran) and all(m["nic_bytes_ok"] for m in ran.values())}),
        "nothing left after down": all(v["count"] == 0 for v in summary["leftovers"].values()),
        "nothing left after SIGKILL + clean": all(
            v["count"] == 0 for v in summary["after_kill_and_clean"]["leftovers"].values()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-id", default=time.strftime("%Y%m%d-%H%M%S"))
    ap.add_argument("--smp", type=int, default=1)
    ap.add_argument("--iperf-s", type=int, default=5)
    ap.add_argument("--trajectories", type=int, default=1)
    ap.add_argument("--no-run", dest="run", action="store_false", help="skip `dualpath run` (every mode with d0 "
                    "in the guest, about 20 minutes under TCG): the wiring, traffic and cleanup only")
    ap.add_argument("--place", default="d0=guest", help="units the guest holds (default d0=guest; s0 is the "
                    "storage server)")
    ap.add_argument("--modes", default=MODES, help=f"the run's modes (default every one: {MODES})")
    args = ap.parse_args()
    place = parse_place(args.place)
    crossing(place)  # a placement the traffic step cannot measure fails here, before the guest boots
    if os.geteuid() != 0:
        print("cluster-test: needs root (namespaces, a tap device, QEMU)", file=sys.stderr)
        return 2
    out = REPO / "results" / "cluster" / args.run_id
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    subprocess.run(["bash", "scripts/vm.sh", "build"], cwd=REPO, check=True)
    wall = {"image_build_or_cache_check": round(time.monotonic() - t0, 1)}
    summary: dict = {"run_id": args.run_id, "servers": ["host", "guest"], "placement": None}
    with GuestServer(args.run_id, smp=args.smp) as guest:
        wall["guest_boot"] = round(guest.boot_s or 0, 1)
        summary["guest_clock_offset_s"] = guest.clock_offset_s
        topo_path = write_topology(out, guest, place)
        g = guest.spec("guest", nic_gbps=10)
        from testbed.placement import placement
        from testbed.topology import load_topology

        summary["placement"] = placement(load_topology(topo_path))
        topo = cli("topo", str(topo_path))
        prep = cli("cluster", "prepare", str(topo_path), timeout=300)
        summary["topo_ok"] = topo.returncode == 0
        summary["prepare"] = {"ok": prep.returncode == 0, "lines": prep.stdout.strip().splitlines()}
        t1 = time.monotonic()
        st = up_state(topo_path)
        wall["fabric_up"] = round(time.monotonic() - t1, 1)
        summary["fabric_up"] = st is not None
        if st is not None:
            summary["traffic"] = traffic(topo_path, g, args.iperf_s, place)
            cli("down")
        if args.run:
            t2 = time.monotonic()
            summary["run"] = run_modes(topo_path, out, args.trajectories, args.modes)
            wall["run"] = round(time.monotonic() - t2, 1)
        summary["leftovers"] = {"host": local_leftovers(), "guest": guest_leftovers(g)}
        st = up_state(topo_path)
        killed = None
        if st is not None:
            killed = int(st["owner"]["pid"])
            os.kill(killed, signal.SIGKILL)
            time.sleep(1)
        cl = cli("clean", str(topo_path), timeout=600)
        summary["after_kill_and_clean"] = {"killed_runner_pid": killed, "clean_rc": cl.returncode,
                                           "leftovers": {"host": local_leftovers(), "guest": guest_leftovers(g)}}
    wall["total"] = round(time.monotonic() - t0, 1)
    summary["modes"] = summary.get("run", {}).get("modes")
    summary["wall_s"] = wall
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    checks = checks_of(summary, args.modes if args.run else None)
    for name, ok in checks.items():
        print(f"cluster-test: {'ok  ' if ok else 'FAIL'} {name}")
    print(f"cluster-test: {out / 'summary.json'}; wall {wall}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
