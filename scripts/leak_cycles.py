#!/usr/bin/env python3
"""Bring the testbed up and down N times, ending each runner with SIGINT, SIGTERM or SIGKILL in
rotation (after a SIGKILL, `dualpath clean`), and count what is left after every cycle:
namespaces, veths, bridges, qdiscs, nft tables, processes and mounts.

    .venv/bin/python scripts/leak_cycles.py --cycles 100
    .venv/bin/python scripts/leak_cycles.py --cycles 20 --detach

--detach: `dualpath up --detach`, then `dualpath exec`, then an ending: `dualpath down`,
SIGTERM to the runner, or SIGKILL to the runner followed by `dualpath down` or (the
last cycles) `dualpath clean`; a second `up` while the killed runner's testbed is there
must fail with the one-line error that names `dualpath down`.

Most cycles are `dualpath up` (the fabric: namespaces, veths, bridges, qdiscs, nft tables,
Mininet shells). Every --run-every'th cycle is a whole `dualpath run` instead (store servers,
host agents and engines in the namespaces, and a store root on its own tmpfs, from a disk-full
fault), signalled once its requests are flowing. Prints one line per cycle (how it ended, its
seconds, leftovers), then the totals, and exits non-zero if any cycle left anything behind.
Run it with nothing else using the dpt- prefix on the machine. With a `hosts: docker` topology
(--topology topologies/1p1d-docker.yaml) every cycle also brings the testbed's own dockerd and
its containers up and down, and the leftovers counted include containers, daemon processes and
their mounts.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed.fabric.cleanup import find_leftovers  # noqa: E402

CLI = [sys.executable, "-m", "testbed.cli"]
ENDINGS = ("SIGINT", "SIGTERM", "SIGKILL")
DETACHED_ENDINGS = ("down", "SIGKILL+down", "SIGTERM", "SIGKILL+clean")


def run_args(topo: str) -> list[str]:
    """A small `dualpath run` of `topo`, with a fault. With hosts: docker the fault is a store crash
    instead of a full disk: a store's own tmpfs is mounted in the root namespace, which a
    container's mounts do not see, so the testbed refuses that combination."""
    from testbed.topology import load_topology

    fault = "store-crash@0.2" if load_topology(topo).spec.hosts == "docker" else "disk-full@0.2"
    return ["run", topo, "--modes", "dualpath", "--trajectories", "2", "--fault", fault,
            "--out", "/var/tmp/dpt-leak-results"]


def _wait_line(p: subprocess.Popen, want: str, timeout_s: float) -> str:
    """Read the child's stdout until a line containing `want`; returns it ('' on EOF/timeout)."""
    deadline = time.monotonic() + timeout_s
    buf = b""
    fd = p.stdout.fileno()
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.1)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                return ""
            buf += chunk
            for line in buf.decode(errors="replace").splitlines():
                if want in line:
                    return line
    return ""


def one_cycle(topo: str, ending: str, full_run: bool) -> tuple[float, str, str]:
    """(seconds, leftovers right after the runner ended, leftovers after clean if it was killed)."""
    t0 = time.monotonic()
    if full_run:
        p = subprocess.Popen([*CLI, *run_args(topo)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        ready = _wait_line(p, "requests", 300)  # the mode's progress: requests are flowing
    else:
        p = subprocess.Popen([*CLI, "up", topo, "--hold", "60"], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)
        ready = _wait_line(p, "up in", 60)
    if not ready:
        p.kill()
        p.wait(60)
        subprocess.run([*CLI, "clean"], cwd=REPO, capture_output=True, timeout=120)
        raise SystemExit(f"bring-up failed ({'run' if full_run else 'up'}); cleaned up")
    p.send_signal(getattr(signal, ending))
    p.wait(timeout=120)
    p.stdout.close()
    elapsed = time.monotonic() - t0
    before = find_leftovers().summary()
    if ending == "SIGKILL":
        subprocess.run([*CLI, "clean"], cwd=REPO, check=True, capture_output=True, timeout=120)
    return elapsed, before, find_leftovers().summary()


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _wait_gone(pid: int, timeout_s: float = 60) -> None:
    from testbed.fabric.rundir import proc_start

    deadline = time.monotonic() + timeout_s
    while proc_start(pid) is not None:
        if time.monotonic() > deadline:
            raise SystemExit(f"runner {pid} still alive {timeout_s:g}s after its ending")
        time.sleep(0.02)


def one_detached_cycle(topo: str, ending: str) -> tuple[float, float, str]:
    """(the up command's seconds, up to no leftovers seconds, leftovers)."""
    t0 = time.monotonic()
    r = _cli("up", topo, "--detach", "--json")
    if r.returncode != 0:
        raise SystemExit(f"up --detach failed: {r.stderr.strip()}")
    up_s = time.monotonic() - t0
    runner = json.loads(r.stdout)["owner"]["pid"]
    e = _cli("exec", "p0e0", "--", "ip", "-br", "link", "show", "dev", "dpt-p0e0-cnic")
    if e.returncode != 0 or "dpt-p0e0-cnic" not in e.stdout:
        raise SystemExit(f"exec failed ({e.returncode}): {e.stderr.strip()}")
    if ending.startswith("SIGKILL"):
        os.kill(runner, signal.SIGKILL)
        _wait_gone(runner)
        again = _cli("up", topo, "--detach")
        if again.returncode != 1 or "`dualpath down`" not in again.stderr or len(again.stderr.splitlines()) != 1:
            raise SystemExit(f"a second up over a dead runner's testbed did not fail clearly: {again.stderr!r}")
        _cli("clean" if ending.endswith("clean") else "down").check_returncode()
    elif ending == "SIGTERM":
        os.kill(runner, signal.SIGTERM)
        _wait_gone(runner)
    else:
        _cli("down").check_returncode()
        _wait_gone(runner, 1)  # down returns only once its runner is gone
    return up_s, time.monotonic() - t0, find_leftovers().summary()


class _Tee:
    """stdout to the terminal and to the --log file at once."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--topology", default=str(REPO / "topologies" / "1p1d.yaml"))
    ap.add_argument("--run-every", type=int, default=10, help="every Nth cycle is a whole `dualpath run` (0: none)")
    ap.add_argument("--detach", action="store_true", help="cycle `dualpath up --detach` and its endings")
    ap.add_argument("--log", type=Path, help="also write every line to this file, after the command that made it")
    args = ap.parse_args()
    if args.log:
        args.log.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout = _Tee(sys.stdout, args.log.open("w"))
        print(f"produced by: .venv/bin/python scripts/leak_cycles.py {' '.join(sys.argv[1:])}\n"
              f"started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, {os.cpu_count()} CPUs")
    if not find_leftovers().empty():
        print("leftovers exist before the first cycle; run `dualpath clean` first", file=sys.stderr)
        return 2
    if args.detach:
        return detached_cycles(args.cycles, args.topology)
    bad = 0
    times = []
    t_all = time.monotonic()
    for i in range(args.cycles):
        ending = ENDINGS[i % len(ENDINGS)]
        full = bool(args.run_every) and i % args.run_every == args.run_every - 1
        elapsed, before, left = one_cycle(args.topology, ending, full)
        times.append(elapsed)
        bad += left != "nothing"
        killed = f" (before clean: {before})" if ending == "SIGKILL" else ""
        print(f"cycle {i + 1:3d}  {'run' if full else 'up':<3} {ending:<7}  {elapsed:6.2f}s  "
              f"leftovers: {left}{killed}", flush=True)
    print(f"{args.cycles} cycles ({sum(t % args.run_every == args.run_every - 1 for t in range(args.cycles)) if args.run_every else 0} "
          f"of them whole runs), {bad} with leftovers; {time.monotonic() - t_all:.0f} s in all; per cycle "
          f"(incl. python start-up) median {sorted(times)[len(times) // 2]:.2f}s, max {max(times):.2f}s")
    return 1 if bad else 0


def detached_cycles(cycles: int, topo: str) -> int:
    bad = 0
    ups, totals = [], []
    for i in range(cycles):
        ending = DETACHED_ENDINGS[i % len(DETACHED_ENDINGS)]
        up_s, total_s, left = one_detached_cycle(topo, ending)
        ups.append(up_s)
        totals.append(total_s)
        bad += left != "nothing"
        print(f"cycle {i + 1:2d}  {ending:<13}  up {up_s:5.2f}s  up..gone {total_s:5.2f}s  leftovers: {left}",
              flush=True)
    _cli("clean").check_returncode()
    left = find_leftovers().summary()
    bad += left != "nothing"
    print(f"after `dualpath clean`: leftovers: {left}")
    print(f"{cycles} detached cycles, {bad} with leftovers; `up --detach` command (incl. python start-up) "
          f"median {sorted(ups)[len(ups) // 2]:.2f}s, max {max(ups):.2f}s; whole cycle median "
          f"{sorted(totals)[len(totals) // 2]:.2f}s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
