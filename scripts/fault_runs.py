#!/usr/bin/env python3
"""Issue 14's acceptance: one live `dualpath run --fault` per fault kind on 1p2d, then the fault
table (fault, requests affected, completed, failed, wrong tokens, lost blocks, recovery time)
from each run's summary.json, and a check for leftovers after every run.

    .venv/bin/python scripts/fault_runs.py --out results/faults

snic-down and snic-up share a run (the link goes down, then comes back). Each run is its own
`dualpath run` under a time limit, so one that hangs is reported and the others still run.
Exits non-zero if a run failed to finish, a fault found wrong tokens or lost blocks, or
anything was left behind.
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed.fabric.cleanup import find_leftovers  # noqa: E402
from testbed.paths import shown_path  # noqa: E402

RUNS = {  # name -> the --fault values of its run (T: emulated seconds after the first request)
    "snic": ["snic-down@0.5", "snic-up@1.5"],  # a mode of 4 trajectories lasts about 3 emulated s
    "store-crash": ["store-crash@1"],
    "host-kill": ["host-kill@1"],  # the prefill node's agent (the default target)
    "pe-kill": ["pe-kill@1"],
    "de-kill": ["de-kill@1"],
    "corrupt-block": ["corrupt-block@1"],
    "disk-full": ["disk-full@1"],
}


def one(name: str, faults: list[str], args: argparse.Namespace) -> dict:
    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "testbed.cli", "run", args.topology, "--modes", args.mode,
           "--trajectories", str(args.trajectories), "--seed", str(args.seed), "--out", str(out),
           *[x for f in faults for x in ("--fault", f)]]
    t0 = time.monotonic()
    with open(out / "run.log", "w") as log:
        p = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = p.wait(args.timeout)
        except subprocess.TimeoutExpired:  # a run that hangs is stopped as a user would (^C), then cleaned
            rc = "timeout"
            p.send_signal(signal.SIGINT)
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                subprocess.run([sys.executable, "-m", "testbed.cli", "clean"], cwd=REPO, capture_output=True,
                               timeout=120)
    runs = sorted(p for p in out.iterdir() if p.is_dir())
    summary = json.loads((runs[-1] / "summary.json").read_text()) if runs and (runs[-1] / "summary.json").exists() else None
    return {"name": name, "faults": faults, "rc": rc, "wall_s": round(time.monotonic() - t0, 1),
            "summary": summary, "folder": shown_path(runs[-1]) if runs else None,
            "command": " ".join(["dualpath", *(shown_path(a) for a in cmd[3:])]),
            "leftovers": find_leftovers().summary()}


def table(rows: list[dict]) -> list[str]:
    out = ["| fault | requests affected | completed | failed | wrong tokens | lost blocks | recovery s (emulated) "
           "| run finished | leftovers |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        modes = (r["summary"] or {}).get("modes", {})
        fs = [f for m in modes.values() for f in m.get("faults", [])]
        if not fs:
            out.append(f"| {', '.join(r['faults'])} | - | - | - | - | - | - | no (rc {r['rc']}) | {r['leftovers']} |")
        for f in fs:
            rec = "-" if f.get("recovery_s") is None else f"{f['recovery_s']:.2f}"
            out.append(f"| {f['kind']}:{f['target']}@{f['at_s']:g} | {f['affected']} | {f['completed']} | {f['failed']} "
                       f"| {f['wrong_tokens']} | {f['lost_blocks']} | {rec} | rc {r['rc']}, {r['wall_s']} s "
                       f"| {r['leftovers']} |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", default="topologies/1p2d.yaml", help="relative to the repository")
    ap.add_argument("--mode", default="dualpath")
    ap.add_argument("--trajectories", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take")
    ap.add_argument("--out", default=str(REPO / "results" / "faults"))
    ap.add_argument("--not-after", type=float, default=0.0,
                    help="Unix time after which no further run starts (0: none); the table has those done")
    args = ap.parse_args()
    names = [n for n in args.runs.split(",") if n]
    if bad := [n for n in names if n not in RUNS]:
        print(f"--runs: unknown {', '.join(bad)}; expected some of {', '.join(RUNS)}", file=sys.stderr)
        return 2
    rows = []
    for n in names:
        if args.not_after and time.time() > args.not_after:
            print(f"not started (--not-after): {n}", flush=True)
            continue
        rows.append(one(n, RUNS[n], args))
        print("\n".join(table(rows[-1:])[2:]), flush=True)
    lines = table(rows)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    made_by = " ".join([".venv/bin/python scripts/fault_runs.py", *(shown_path(a) for a in sys.argv[1:])])
    (Path(args.out) / "table.md").write_text(f"produced by: `{made_by}`\n\n" + "\n".join(lines) + "\n\ncommands:\n" + "\n".join(
        f"- `{r['command']}` -> {r['folder']}" for r in rows) + "\n")
    print("\n".join(lines))
    ok = all(r["rc"] in (0, 1) and r["summary"] and r["leftovers"] == "nothing"
             and all(f["wrong_tokens"] == 0 and f["lost_blocks"] == 0
                     for m in r["summary"]["modes"].values() for f in m.get("faults", [])) for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
