"""Figures 10 and 11 for the paper's own models, simulated: online serving of DS 27B on 1P1D and
DS 660B on 2P4D, the two the paper plots (issue 38, item 4).

The testbed's online runs serve Qwen2.5-32B on 1P1D at lengths / 32 (testbed.reproduce.online);
one 2-core host cannot run the paper's clusters. Here each (model, APS, mode) point is a
simulation of the paper's cluster (paper_rows.PaperRow, scale.paper_cluster) in the target's
units: agents arrive as the testbed's Poisson process, and the point is judged by the same SLO
and steady-state rule (online.slo_verdict) and searched by the same bisection (online.search) to a
10 % bracket [met, failed). Every point says `source: simulated` and `faithful: null`; the report
puts the simulator's committed validation error beside them.

Scale-down, stated:
* the workload is the 64K trace set at the paper's lengths (the paper does not name its online
  set), each agent's trajectory cut to its last KEEP_TURNS turns: its earlier context is in the
  store when it arrives (its first request reads it back, as a mid-trajectory turn does), so
  every request has the paper's context and KV, and an agent brings about 157 / KEEP_TURNS times
  fewer requests. Capacities in APS are that many times the paper's; the capacity ratio,
  DualPath over Basic, is what compares with the paper's 1.67x and 2.25x;
* agents arrive for SPAN_JCTS times an agent's unloaded JCT (two agents alone), so that the load
  reaches its level well before the measured span's second half (the steady test's lag); at most
  MAX_AGENTS per point.
"""
from __future__ import annotations

import math
import time
from functools import lru_cache
from typing import Any, Callable

from testbed.reproduce import online, paper
from testbed.reproduce.paper_rows import PAPER_ROWS, PaperRow

PRESET = "64K"
KEEP_TURNS = {True: 10, False: 20}  # --quick, full: each agent's last turns
SPAN_JCTS = 4.0
MAX_AGENTS = 4000
MAX_PROBES = 7
ROWS = tuple(r for r in PAPER_ROWS if r.label in paper.FIG10_CAPACITY)
PLAN_NOTE = ("then the paper's models in the simulator (no testbed run): "
             + ", ".join(f"{r.label} on {r.cluster}" for r in ROWS)
             + ", each mode searched to a 10 % bracket (a few minutes of simulation)")


def _cluster(row: PaperRow):
    from simulator.calibration import UNCALIBRATED
    from testbed.reproduce.scale import paper_cluster
    from testbed.sim.drive import sim_config

    return sim_config(paper_cluster(row.prefill_nodes, row.decode_nodes, row.model), units="target", cal=UNCALIBRATED)


def agent_tails(agents: int, quick: bool, dilation: float, aps: float | None, seed: int):
    """The 64K set's agents at the paper's lengths, each cut to its last KEEP_TURNS turns with the
    context before them as its stored prefix; Poisson arrivals at `aps` (None: all at once)."""
    from testbed.reproduce.plan import WorkloadSpec
    from testbed.sim.drive import trajectories

    wl = WorkloadSpec(preset=PRESET, scale=1, agents=agents, seed=seed).config()
    return [t.joined_at(max(0, len(t.turns) - KEEP_TURNS[quick]))
            for t in trajectories(wl, dilation, aps=aps, arrival_seed=seed)]


def sim_requests(records, dilation: float) -> list[dict[str, Any]]:
    """Simulated request records in `online.requests`' form (emulated seconds)."""
    from testbed.measure.metrics import token_latencies

    out = []
    for r in records:
        lat = token_latencies(r.t_arrive, r.token_times) if r.token_times else {}
        out.append({"trajectory": r.trajectory, "turn": r.turn, "arrive": r.t_arrive / dilation,
                    "done": r.t_done / dilation, "error": bool(r.error),
                    **{k: (lat[k] / dilation if lat.get(k) is not None else None) for k in ("ttft", "ttst", "tpot")}})
    return sorted(out, key=lambda x: x["arrive"])


@lru_cache(maxsize=8)
def unloaded_jct_s(row: PaperRow, quick: bool, seed: int = 0) -> float:
    """An agent's mean JCT with the cluster nearly to itself (two agents): the span's unit."""
    from testbed.sim.drive import simulate

    cfg = _cluster(row)
    res = simulate(cfg, agent_tails(2, quick, cfg.dilation, None, seed), ["dualpath"])["dualpath"]
    return online.mean(online.agent_jcts(sim_requests(res.records, cfg.dilation)))


def simulate_point(row: PaperRow, aps: float, mode: str, quick: bool, seed: int = 0) -> dict[str, Any]:
    """One (APS, mode) point on the paper's cluster of `row`, simulated."""
    from testbed.sim.drive import simulate

    cfg = _cluster(row)
    agents = max(8, min(MAX_AGENTS, math.ceil(aps * SPAN_JCTS * unloaded_jct_s(row, quick))))
    trajs = agent_tails(agents, quick, cfg.dilation, aps, seed)
    t = time.perf_counter()
    res = simulate(cfg, trajs, [mode])[mode]
    reqs = sim_requests(res.records, cfg.dilation)
    return {**online.point_of(reqs, aps, mode), "source": "simulated", "faithful": None, "requests": len(reqs),
            "sim_wall_s": round(time.perf_counter() - t, 1)}


def first_probe(row: PaperRow, mode: str, quick: bool) -> float:
    """Where a mode's search starts: the APS its reading storage NICs can serve (Basic: the
    prefill nodes' SNICs; DualPath: every node's), from the workload's hit bytes per agent."""
    cfg = _cluster(row)
    hit = 0  # each turn reads its context so far back (the hit rate is above 95 %)
    for t in agent_tails(64, quick, cfg.dilation, None, 0):
        ctx = t.system_prompt_len
        for append, gen in t.turns:
            hit += ctx
            ctx += append + gen
    per_agent = hit * cfg.kv_bytes_per_token / 64
    readers = row.prefill_nodes + (row.decode_nodes if mode != "basic" else 0)
    return readers * cfg.snic_bps / 8 / per_agent


def search_row(row: PaperRow, quick: bool, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Each mode's capacity on `row`'s cluster: probes from its I/O bound, bisected to 10 %."""
    points: dict[str, list[dict]] = {}
    for mode in online.MODES:
        done: list[dict] = []

        def evaluate(aps: float) -> bool:
            p = simulate_point(row, aps, mode, quick)
            done.append(p)
            progress(f"  simulated {row.label} {row.cluster} {mode} at {aps:.3g} APS: "
                     f"{'meets' if p['meets_slo'] else 'fails'} the SLO ({p['requests']} requests in {p['sim_wall_s']} s)")
            return p["meets_slo"]

        a0 = first_probe(row, mode, quick)
        online.search(evaluate, [(a0, evaluate(a0))], max_probes=MAX_PROBES - 1)
        points[mode] = done
    br = online.brackets(points)
    common = br["basic"]["met"]  # fig11 compares the modes' JCTs where both meet the SLO: Basic's capacity
    if common is not None and all(p["aps"] != common for p in points["dualpath"]):
        points["dualpath"].append(simulate_point(row, common, "dualpath", quick))
    points = {m: sorted(pts, key=lambda p: p["aps"]) for m, pts in points.items()}
    return {"model": row.label, "cluster": row.cluster, "target": row.model, "source": "simulated", "faithful": None,
            "keep_turns": KEEP_TURNS[quick], "points": points, "brackets": br,
            "ratio": (br["dualpath"]["met"] / br["basic"]["met"]) if br["basic"]["met"] and br["dualpath"]["met"] else None,
            "ratio_interval": online.ratio_interval(br["dualpath"], br["basic"]),
            "paper_ratio": paper.FIG10_CAPACITY_RATIO[row.label], "unloaded_jct_s": unloaded_jct_s(row, quick),
            "bound": (row.prefill_nodes + row.decode_nodes) / row.prefill_nodes}  # (P+D)/P: every node's SNIC reads


@lru_cache(maxsize=2)
def models(quick: bool) -> tuple[dict[str, Any], ...]:
    """Every model the paper plots in figures 10 and 11, searched once per process (fig10 and fig11
    read the same points)."""
    return tuple(search_row(r, quick) for r in ROWS)
