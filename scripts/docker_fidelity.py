#!/usr/bin/env python3
"""Does `hosts: docker` cost fidelity, and do CPU shares for the engines' containers win it back?

Runs the same `dualpath run` side by side, round after round, in three variants of one topology:
namespaces (Mininet hosts), docker, and docker with `container_limits: {engine: {cpu_shares: N}}`.
The default load (1p1d-io at scale 0.0025, dualpath mode, 24 trajectories) keeps both cores of
the 2-core dev machine 80-87 % busy, at the edge of the fidelity verdict, where the scheduler's
choices between processes decide whether passes keep their emulated windows. Prints, per run,
the prefill passes and decode steps that overran, how late they were in all (share of the JCT)
and the verdict, then the totals per variant.

    .venv/bin/python scripts/docker_fidelity.py --rounds 2

Writes the variants' topologies and every run's folder under --out (default build/docker-fidelity).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "testbed.cli"]


def variants(base: Path, scale: float, shares: int, out: Path) -> dict[str, Path]:
    spec = yaml.safe_load(base.read_text())
    spec["scale"] = scale
    made = {}
    for name, extra in (("namespaces", {}), ("docker", {"hosts": "docker"}),
                        (f"docker+engine-shares-{shares}",
                         {"hosts": "docker", "container_limits": {"engine": {"cpu_shares": shares}}})):
        path = out / "topologies" / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump({**spec, "name": f"{spec['name']}-{name.replace('+', '-')}", **extra}))
        made[name] = path
    return made


def one_run(topo: Path, args: argparse.Namespace, out: Path) -> dict:
    before = set(out.glob("*/summary.json"))
    r = subprocess.run([*CLI, "run", str(topo), "--trajectories", str(args.trajectories), "--modes", args.mode,
                        "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=1800)
    new = sorted(set(out.glob("*/summary.json")) - before)
    if r.returncode != 0 or not new:  # an UNFAITHFUL run still exits 0: the verdict is data here
        raise SystemExit(f"dualpath run {topo.name} failed ({r.returncode}): {r.stderr.strip()[-400:]}")
    mode = json.loads(new[-1].read_text())["modes"][args.mode]
    fid = mode["fidelity"]
    return {"run": new[-1].parent.name, "faithful": bool(mode.get("faithful")),
            "prefill_overran": fid["prefill_overran"], "prefill_passes": fid["prefill_passes"],
            "decode_overran": fid["decode_overran"], "decode_steps": fid["decode_steps"],
            "late_share": fid["late_share_of_jct"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", type=Path, default=REPO / "topologies" / "1p1d-io.yaml")
    ap.add_argument("--scale", type=float, default=0.0025)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--trajectories", type=int, default=24)
    ap.add_argument("--mode", default="dualpath")
    ap.add_argument("--engine-shares", type=int, default=8192)
    ap.add_argument("--out", type=Path, default=REPO / "build" / "docker-fidelity")
    args = ap.parse_args()
    topos = variants(args.topology, args.scale, args.engine_shares, args.out)
    print(f"produced by: .venv/bin/python scripts/docker_fidelity.py {' '.join(sys.argv[1:])}")
    print(f"{args.topology.name} at scale {args.scale:g}, mode {args.mode}, {args.trajectories} trajectories, "
          f"{args.rounds} round(s)")
    results: dict[str, list[dict]] = {v: [] for v in topos}
    for i in range(args.rounds):
        for name, topo in topos.items():
            r = one_run(topo, args, args.out / "runs" / name.replace("+", "-"))
            results[name].append(r)
            print(f"round {i + 1}  {name:<28} prefill overran {r['prefill_overran']:3d}/{r['prefill_passes']:<4d} "
                  f"decode overran {r['decode_overran']:3d}/{r['decode_steps']:<4d} late {100 * r['late_share']:.2f} % "
                  f"of JCT  {'FAITHFUL' if r['faithful'] else 'UNFAITHFUL'}  ({r['run']})", flush=True)
    print("totals:")
    for name, rs in results.items():
        print(f"  {name:<28} FAITHFUL {sum(r['faithful'] for r in rs)}/{len(rs)}, prefill passes overran "
              f"{sum(r['prefill_overran'] for r in rs)}, decode steps overran {sum(r['decode_overran'] for r in rs)}")
    (args.out / "summary.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
