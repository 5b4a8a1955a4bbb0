#!/usr/bin/env python3
"""Bring 1p1d up and down N times, ending some runners with SIGINT and some with
SIGKILL (then `dualpath clean`), and count what is left after every cycle.

    .venv/bin/python scripts/leak_cycles.py --cycles 20

Prints one line per cycle (how it ended, bring-up + teardown seconds, leftovers)
and exits non-zero if any cycle left anything behind.
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed.cleanup import find_leftovers  # noqa: E402

CLI = [sys.executable, "-m", "testbed.cli"]
ENDINGS = ("normal", "SIGINT", "SIGKILL", "SIGTERM")


def one_cycle(topo: str, ending: str) -> tuple[float, str]:
    t0 = time.monotonic()
    hold = "0.01" if ending == "normal" else "60"
    p = subprocess.Popen([*CLI, "up", topo, "--hold", hold], cwd=REPO, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    line = p.stdout.readline()
    if not line.startswith("up in"):
        p.kill()
        raise SystemExit(f"bring-up failed: {line!r}")
    if ending != "normal":
        p.send_signal(getattr(signal, ending))
    p.wait(timeout=60)
    elapsed = time.monotonic() - t0
    if ending == "SIGKILL":
        subprocess.run([*CLI, "clean"], cwd=REPO, check=True, capture_output=True, timeout=60)
    return elapsed, find_leftovers().summary()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--topology", default=str(REPO / "topologies" / "1p1d.yaml"))
    args = ap.parse_args()
    if not find_leftovers().empty():
        print("leftovers exist before the first cycle; run `dualpath clean` first", file=sys.stderr)
        return 2
    bad = 0
    times = []
    for i in range(args.cycles):
        ending = ENDINGS[i % len(ENDINGS)]
        elapsed, left = one_cycle(args.topology, ending)
        times.append(elapsed)
        bad += left != "nothing"
        print(f"cycle {i + 1:2d}  {ending:<7}  up+down {elapsed:5.2f}s  leftovers: {left}", flush=True)
    print(f"{args.cycles} cycles, {bad} with leftovers; up+down (incl. python start-up) "
          f"median {sorted(times)[len(times) // 2]:.2f}s, max {max(times):.2f}s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
