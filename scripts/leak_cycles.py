#!/usr/bin/env python3
"""Bring the testbed up and down N times, ending each runner with SIGINT, SIGTERM or SIGKILL in
rotation (after a SIGKILL, `dualpath clean`), and count what is left after every cycle:
namespaces, veths, bridges, qdiscs, nft tables, processes and mounts.

    .venv/bin/python scripts/leak_cycles.py --cycles 100

Most cycles are `dualpath up` (the fabric: namespaces, veths, bridges, qdiscs, nft tables,
Mininet shells). Every --run-every'th cycle is a whole `dualpath run` instead (store servers,
host agents and engines in the namespaces, and a store root on its own tmpfs, from a disk-full
fault), signalled once its requests are flowing. Prints one line per cycle (how it ended, its
seconds, leftovers), then the totals, and exits non-zero if any cycle left anything behind.
Run it under the machine-wide lock: `flock /work/testbed.lock .venv/bin/python scripts/leak_cycles.py`.
"""
from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed.cleanup import find_leftovers  # noqa: E402

CLI = [sys.executable, "-m", "testbed.cli"]
ENDINGS = ("SIGINT", "SIGTERM", "SIGKILL")
RUN_ARGS = ["run", str(REPO / "topologies" / "1p1d.yaml"), "--modes", "dualpath", "--trajectories", "2",
            "--fault", "disk-full@0.2", "--out", "/var/tmp/dpt-leak-results"]


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
        p = subprocess.Popen([*CLI, *RUN_ARGS], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--topology", default=str(REPO / "topologies" / "1p1d.yaml"))
    ap.add_argument("--run-every", type=int, default=10, help="every Nth cycle is a whole `dualpath run` (0: none)")
    args = ap.parse_args()
    if not find_leftovers().empty():
        print("leftovers exist before the first cycle; run `dualpath clean` first", file=sys.stderr)
        return 2
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


if __name__ == "__main__":
    sys.exit(main())
