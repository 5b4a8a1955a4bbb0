"""`dualpath calibrate scale`: the largest link scale (the smallest dilation) a topology's run keeps FAITHFUL.

The dilation k stretches the target's time so that the CPU's work fits into it; the link scale
sets k (emulated times do not depend on it). A larger scale makes every run shorter and the CPU's
headroom smaller, until passes overrun and the run is UNFAITHFUL. This search runs the topology's
workload at growing scales from the file's own until a run is not FAITHFUL, bisects between the
last FAITHFUL scale and the first that was not (the APS search's bisection,
testbed.reproduce.online.search), and recommends the edge less a stated margin: near the edge a
verdict is a coin that the machine's other work can flip.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Callable

GROW = 2.0  # each probe's scale over the last FAITHFUL one until one is not


def probe_config(topology: Path, scale: float, modes: tuple[str, ...], agents: int, seed: int):
    """One probe: the topology at `scale`, the demo workload of `agents` agents."""
    from dualpath.workload.spec import WorkloadSpec
    from testbed.reproduce.plan import RunConfig
    from testbed.topology import load_topology

    # topology_with joins the name under topologies/ (an absolute path stands for itself) and
    # would name the result after the whole path: the file's own name says it
    path = topology.resolve()
    name = re.sub(r"[^A-Za-z0-9_.-]", "", f"{load_topology(path).name}-scale{scale:.4g}")[:60]
    return RunConfig(f"calibrate/scale={scale:.4g}", str(path.with_suffix("")), modes,
                     WorkloadSpec(agents=agents, seed=seed), topology_overrides={"scale": round(scale, 6), "name": name})


def search_scale(evaluate: Callable[[float], bool], start: float, max_probes: int, rel_tol: float
                 ) -> tuple[float | None, list[tuple[float, bool]]]:
    """(the highest scale found FAITHFUL, every probe): from `start`, up by GROW while FAITHFUL (down
    while not), then bisection to `rel_tol`; at most `max_probes` runs."""
    from testbed.reproduce.online import search

    pts = [(start, bool(evaluate(start)))]
    while len(pts) < max_probes and len({ok for _, ok in pts}) == 1:
        s = max(x for x, _ in pts) * GROW if pts[0][1] else min(x for x, _ in pts) / GROW
        pts.append((s, bool(evaluate(s))))
    return search(evaluate, pts, rel_tol, max_probes - len(pts))


def recommend(points: list[tuple[float, bool]], margin: float) -> dict[str, Any]:
    """The bracket the probes left, and the scale to use: the FAITHFUL edge / (1 + margin)."""
    from testbed.reproduce.online import bracket

    b = bracket(points)
    return {"faithful_up_to": b["met"], "unfaithful_at": b["failed"], "margin": margin,
            "scale": round(b["met"] / (1 + margin), 6) if b["met"] else None,
            "bracketed": b["met"] is not None and b["failed"] is not None}


def calibrate_scale(topology: Path, out: Path, *, modes: tuple[str, ...] = ("dualpath",), agents: int = 24,
                    seed: int = 0, margin: float = 0.25, max_probes: int = 6, rel_tol: float = 0.1,
                    command: str = "", progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the search (needs root and the testbed); returns summary.json's contents."""
    from dualpath.model.registry import prepare_tiny
    from testbed.cluster.runclock import run_geometry
    from testbed.reproduce.execute import run_config
    from testbed.topology import load_topology

    kv = run_geometry(prepare_tiny()).kv_bytes_per_token
    start = load_topology(topology).spec.scale
    probes: list[dict[str, Any]] = []

    def evaluate(scale: float) -> bool:
        cfg = probe_config(topology, scale, modes, agents, seed)
        k = cfg.topology_obj().dilation(kv)
        progress(f"probe {len(probes) + 1}: scale {scale:.4g} (k = {k:.3g})")
        t0 = time.monotonic()
        run = run_config(cfg, out / "runs" / f"scale{scale:.4g}-{cfg.digest()}", command, progress)
        why = run.unfaithful(modes)
        probes.append({"scale": round(scale, 6), "dilation": round(k, 4), "faithful": not why,
                       "reasons": why, "wall_s": round(time.monotonic() - t0, 1), "run": str(run.path),
                       "cpu_busy": {m: run.summary["modes"][m].get("cpu_busy") for m in modes
                                    if m in run.summary.get("modes", {})}})
        progress(f"  -> {'FAITHFUL' if not why else 'UNFAITHFUL: ' + '; '.join(r for rs in why.values() for r in rs)[:300]}")
        return not why

    _, pts = search_scale(evaluate, start, max_probes, rel_tol)
    rec = recommend(pts, margin)
    if rec["scale"]:
        rec["dilation"] = round(probe_config(topology, rec["scale"], modes, agents, seed).topology_obj().dilation(kv), 4)
    from testbed.paths import code_version

    return {"command": command, **NOT_A_RESULT, "code": code_version(), "topology": str(topology), "file_scale": start,
            "file_dilation": round(load_topology(topology).dilation(kv), 4), "modes": list(modes),
            "agents": agents, "seed": seed, "probes": probes, "recommended": rec}


# A search's probes past the edge are UNFAITHFUL on purpose: that is how the edge is found. Its
# summary and report say so at the top, so that nobody reads a probe as a measurement.
NOT_A_RESULT = {"faithful": False, "result": False,
                "verdict": "not a result: a search for the edge of fidelity, whose probes above the edge were "
                           "UNFAITHFUL (CPU-saturated or late) by design; only the FAITHFUL probes' verdicts and "
                           "the recommended scale are used, and no number here is a measurement of the paper's"}


def report_lines(s: dict[str, Any]) -> list[str]:
    rec = s["recommended"]
    lines = [f"NOT A RESULT. {NOT_A_RESULT['verdict'][len('not a result: '):]}.", "",
             f"{s['topology']}: the file's scale {s['file_scale']:g} (k = {s['file_dilation']:.3g}); "
             f"{', '.join(s['modes'])} with {s['agents']} agents (seed {s['seed']})"]
    for p in s["probes"]:
        lines.append(f"  scale {p['scale']:<9g} k = {p['dilation']:<6.3g} {'FAITHFUL' if p['faithful'] else 'UNFAITHFUL'}"
                     f"  CPU busy {', '.join(f'{m} {v:.0%}' for m, v in p['cpu_busy'].items() if v is not None)}"
                     f"  ({p['wall_s']:.0f} s)")
    if rec["scale"]:
        edge = (f"FAITHFUL up to {rec['faithful_up_to']:g}" + (f", not at {rec['unfaithful_at']:g}"
                if rec["unfaithful_at"] else " (every probe was: a lower bound)"))
        lines.append(f"{edge}; recommended scale {rec['scale']:g} (k = {rec['dilation']:.3g}), "
                     f"{rec['margin']:.0%} under the edge")
    else:
        lines.append("no probe was FAITHFUL: the CPU cannot keep this topology's time even at the file's scale "
                     "and below it")
    return lines


def write(s: dict[str, Any], run_dir: Path) -> None:
    """summary.json and report.md, each saying first that it is not a result (a summary written
    before NOT_A_RESULT existed gets it, at the top)."""
    s = {**NOT_A_RESULT, **{k: v for k, v in s.items() if k not in NOT_A_RESULT}}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    (run_dir / "report.md").write_text(
        f"# dualpath calibrate scale\n\nThis search is {NOT_A_RESULT['verdict']}.\n\n"
        f"Produced by `{s['command']}`.\n\n```\n" + "\n".join(report_lines(s)) + "\n```\n")
