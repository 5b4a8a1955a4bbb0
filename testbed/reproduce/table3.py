"""Table 3: large-scale scalability, simulated (simulator; scale-down in testbed.reproduce.scale).

Offline: 2P4D against 48P96D with 24x the agents; the paper's near-linear scaling is JCT 3,167 s
against 3,201 s (ratio 1.011): the check is that the simulated ratio is within 10 % of it.
Online: 2P4D at 60 % of its offline throughput against 44P88D at 22x that APS; the paper's TTFT
is 1.739 s against 1.847 s. Both report the scheduler's decision cost measured during the run
(wall seconds inside the scheduler core per simulated second: the cores it needs at the
cluster's speed; the paper's is below 10 cores).
"""
from __future__ import annotations

from functools import partial
from pathlib import Path

from testbed.reproduce import scale
from testbed.reproduce.common import Headline, Result
from testbed.reproduce.plan import Plan

Simulated = partial(Headline, simulated=True)  # every number here is the simulator's, never the testbed's

ID = "table3"
TITLE = "Large-scale scalability (simulated): 2P4D to 48P96D offline, 2P4D to 44P88D online"
SCALING_TOLERANCE = 0.10


def plan(quick: bool = False) -> Plan:
    return Plan(ID, quick, [], scale_down=scale.scale_down(quick))


def analyze(quick: bool = False, progress=print) -> dict:
    off = {name: scale.run_one(name, quick, progress=progress)[1] for name in ("2p4d-paper", "48p96d")}
    small = off["2p4d-paper"]
    aps0 = scale.ONLINE_LOAD * small["agents"] / small["jct_s"]
    on = {"2p4d-paper": scale.run_one("2p4d-paper", quick, aps=aps0, progress=progress)[1],
          "44p88d": scale.run_one("44p88d", quick, aps=aps0 * 22, progress=progress)[1]}
    return {"offline": off, "online": on, "aps_2p4d": aps0}


def reproduce(runs: dict, out: Path, quick: bool = False) -> Result:
    a = analyze(quick)
    off, on, P = a["offline"], a["online"], scale.PAPER
    ratio = off["48p96d"]["jct_s"] / off["2p4d-paper"]["jct_s"]
    paper_ratio = P["offline"]["48p96d"]["jct_s"] / P["offline"]["2p4d-paper"]["jct_s"]
    agent_ratio = off["48p96d"]["agent_jct_s"]["mean"] / off["2p4d-paper"]["agent_jct_s"]["mean"]
    ttft_ratio = on["44p88d"]["ttft_s"]["p50"] / on["2p4d-paper"]["ttft_s"]["p50"]
    paper_ttft_ratio = P["online"]["44p88d"]["ttft_s"] / P["online"]["2p4d-paper"]["ttft_s"]
    cores = max(v["scheduler"]["cores_at_cluster_speed"] or 0 for v in (*off.values(), *on.values()))
    within = abs(ratio / paper_ratio - 1) <= SCALING_TOLERANCE
    heads = [
        Simulated("offline JCT 2P4D (simulated s; paper s at 2K agents)", off["2p4d-paper"]["jct_s"], P["offline"]["2p4d-paper"]["jct_s"]),
        Simulated("offline JCT 48P96D (simulated s; paper s at 48K agents)", off["48p96d"]["jct_s"], P["offline"]["48p96d"]["jct_s"]),
        Simulated("JCT 48P96D / 2P4D at 24x the agents (1 = linear scaling)", ratio, paper_ratio),
        Simulated("agents' mean JCT 48P96D / 2P4D (1 = no agent waits longer at scale)", agent_ratio, None),
        Simulated("online APS 44P88D / 2P4D", on["44p88d"]["aps"] / on["2p4d-paper"]["aps"], P["online"]["44p88d"]["aps"] / P["online"]["2p4d-paper"]["aps"]),
        Simulated("online TTFT p50 2P4D (s)", on["2p4d-paper"]["ttft_s"]["p50"], P["online"]["2p4d-paper"]["ttft_s"]),
        Simulated("online TTFT p50 44P88D (s)", on["44p88d"]["ttft_s"]["p50"], P["online"]["44p88d"]["ttft_s"]),
        Simulated("TTFT 44P88D / 2P4D", ttft_ratio, paper_ttft_ratio),
        Simulated("scheduler cores at the cluster's speed, most of any run (Python core; paper: below 10)", cores,
                 P["scheduler_cores_below"]),
    ]
    notes = [f"Near-linear scaling: JCT ratio {ratio:.4f} against the paper's {paper_ratio:.4f}: "
             f"{'within' if within else 'OUTSIDE'} {SCALING_TOLERANCE:.0%}.",
             f"Offline, every agent starts within the first {scale.START_STAGGER_S * 1e3:.0f} ms (seeded, every "
             "cluster alike): exact copies started in the same instant run in lockstep (testbed/reproduce/scale.py).",
             f"Online: 2P4D offered {a['aps_2p4d']:.4g} APS ({scale.ONLINE_LOAD:.0%} of its offline agents per second), "
             f"44P88D 22x that; the paper's absolute APS are for whole trajectories, ours for {scale.TURNS[quick]} turn(s) "
             "per agent.",
             "Absolute JCTs are not comparable with the paper's: each agent runs a few of its turns (scale-down); "
             "the ratios are what the table claims.",
             "Scheduler cost: wall seconds inside dualpath.scheduler.core per simulated second, on this machine's "
             "CPU, single-threaded Python; the paper's scheduler is its own implementation.",
             f"Paper numbers: {scale.SOURCE}.",
             *[f"{k}: {v['agents']:,} agents, {v['requests']:,} requests, simulated in {v['sim_wall_s']} s "
               f"({v['requests_per_wall_s']} per wall second)" for k, v in off.items()],
             *[f"{k} online: {v['agents']:,} agents at {v['aps']:.4g} APS, simulated in {v['sim_wall_s']} s "
               f"({v['requests_per_wall_s']} per wall second)" for k, v in on.items()]]
    return Result(ID, TITLE, heads, [], data={"offline": off, "online": on, "jct_ratio": ratio,
                                             "agent_jct_ratio": agent_ratio,
                                             "paper_jct_ratio": paper_ratio, "scaling_within_tolerance": within,
                                             "scheduler_cores_max": cores}, notes=notes,
                  scale_down=plan(quick).scale_down, no_runs_needed=True)
