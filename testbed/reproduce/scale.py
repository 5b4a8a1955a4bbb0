"""The simulated scale runs shared by table3 and fig15 (DESIGN.md section 9): the paper's 2P4D,
48P96D and 44P88D clusters (topologies/sim/) in the target's own time, the simulator uncalibrated
(no testbed host: latencies of the target's links and GPUs only).

Scale-down, documented: the paper's 2K agents at 2P4D and 48K at 48P96D (1,000 per prefill node;
Table 3) become AGENTS_PER_PE_NODE agents per prefill node, the same for every cluster, so
48P96D carries 24x the agents of 2P4D as in the paper: 24 copies of 2P4D's agents (replicate);
each agent runs the demo workload
(dualpath.workload.demo_workload: about 10 turns reading back ~100x what they generate, the
paper's trace shape at short lengths), because the simulator's cost grows with requests x
groups (every DE group's leader wakes on each routed request, as the testbed's doorbell does).
Offline, every agent starts at a seeded uniform offset in [0, START_STAGGER_S) target seconds
(stagger), in every cluster alike. Exact copies started in the same instant stay in lockstep:
each turn then reaches the scheduler as a burst of `copies` identical requests, which no trace
of independent agents produces, and requests wait longer on the prefill and decode engines the
larger the cluster (the bursts grow with it). In lockstep, `dualpath reproduce table3` gave a JCT
ratio of 1.197 (at e374668), the agents' mean JCT rising with it; 20 ms, about half a prefill
pass of the demo workload, is enough to break the lockstep while the start stays one burst of
work.
Online, 2P4D is offered 60 % of the agents per second it served offline, and 44P88D 22x that.
"""
from __future__ import annotations

import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from dualpath.workload import demo_workload, poisson_arrivals
from simulator.agents import TrajectorySpec
from testbed.sim.drive import SimResult, sim_config, simulate, trajectories, summarize
from testbed.topology import Topology, load_topology

SIM_TOPOLOGIES = Path(__file__).resolve().parents[2] / "topologies" / "sim"
AGENTS_PER_PE_NODE = {False: 25, True: 5}  # full, --quick
BASE_PREFILL_NODES = 2  # 2P4D: every cluster's agents are copies of its agents
START_STAGGER_S = 0.02  # offline start offsets, target seconds (see the docstring)
ONLINE_LOAD = 0.6  # 2P4D's offered APS as a share of its offline throughput
PE_GROUPS = "one"  # every PE in one group, as the testbed runs them (testbed.sim.drive.sim_config)
PAPER = {"offline": {"2p4d-paper": {"agents": 2000, "jct_s": 3167.0}, "48p96d": {"agents": 48000, "jct_s": 3201.0}},
         "online": {"2p4d-paper": {"aps": 0.4, "ttft_s": 1.739}, "44p88d": {"aps": 8.8, "ttft_s": 1.847}},
         "scheduler_cores_below": 10.0}
SOURCE = "shared/reference/dualpath-paper-notes.txt (Large-Scale Scalability) and the article, section 5.5"


def replicate(trajs: list[TrajectorySpec], copies: int) -> list[TrajectorySpec]:
    """The agents `copies` times over (new ids, the same lengths): a cluster `copies` times the
    base's runs `copies` times its agents, so that perfectly linear scaling keeps the JCT exactly
    (the makespan of more independent draws would grow with their tail, not with the cluster)."""
    n = len(trajs)
    return [replace(t, id=c * n + t.id) for c in range(copies) for t in trajs]


def stagger(trajs: list[TrajectorySpec], window_s: float, seed: int = 0) -> list[TrajectorySpec]:
    """Each agent's start moved to a seeded uniform offset in [0, window_s): a cluster's first
    agents draw the same offsets whatever its size, its copies others."""
    rng = random.Random(seed)
    return [replace(t, arrival_s=t.arrival_s + rng.uniform(0.0, window_s)) for t in trajs]


def topology(name: str) -> Topology:
    return load_topology(SIM_TOPOLOGIES / f"{name}.yaml", carried=False)


def paper_cluster(prefill_nodes: int, decode_nodes: int, model: str) -> Topology:
    """The paper's nodes (2p4d-paper.yaml: 8 H800s with a 400 Gbit/s CNIC each, one 400 Gbit/s
    SNIC per node, a storage tier wider than the SNICs) as a PxD cluster serving `model`: the
    paper's DS 660B on 2P4D, DS 27B on 1P1D and Qwen2.5-32B on 1P2D."""
    import yaml

    from testbed.topology import parse_topology

    path = SIM_TOPOLOGIES / "2p4d-paper.yaml"
    raw = yaml.safe_load(path.read_text())
    raw.update(name=f"{prefill_nodes}p{decode_nodes}d-paper-{model}", prefill_nodes=prefill_nodes,
               decode_nodes=decode_nodes, target={"gpu": "h800", "model": model})
    return parse_topology(raw, source=f"{path} as {prefill_nodes}P{decode_nodes}D of {model}", carried=False)


def run_one(name: str, quick: bool, aps: float | None = None, progress: Callable[[str], None] = print,
            mode: str = "dualpath") -> tuple[SimResult, dict[str, Any]]:
    """One cluster, one mode: the raw result and its summary.json entry."""
    topo = topology(name)
    copies = topo.spec.prefill_nodes / BASE_PREFILL_NODES
    if copies != int(copies):
        raise ValueError(f"{name}: {topo.spec.prefill_nodes} prefill nodes is not a multiple of {BASE_PREFILL_NODES}")
    base = demo_workload(n_trajectories=AGENTS_PER_PE_NODE[quick] * BASE_PREFILL_NODES)
    cfg = sim_config(topo, units="target", pe_groups=PE_GROUPS)
    trajs = replicate(trajectories(base, cfg.dilation), int(copies))
    n = len(trajs)
    wcfg = replace(base, n_trajectories=n)
    if aps:  # the Poisson process over every agent, as the testbed's online runs draw it
        arr = poisson_arrivals(n, aps, 0)
        trajs = [replace(t, arrival_s=a * cfg.dilation) for t, a in zip(trajs, arr)]
    else:
        trajs = stagger(trajs, START_STAGGER_S * cfg.dilation)
    t = time.perf_counter()
    res = simulate(cfg, trajs, [mode])
    summ = summarize(res, cfg, topo, wcfg, "target")["modes"][mode]
    summ["agents"], summ["aps"], summ["sim_wall_s"] = n, aps, round(time.perf_counter() - t, 1)
    progress(f"  {name}: {n} agents{f' at {aps:.4g} APS' if aps else ''}: JCT {summ['jct_s']:.4g} s, TTFT p50 "
             f"{summ['ttft_s']['p50']}, scheduler {summ['scheduler']['cores_at_cluster_speed']} cores "
             f"({summ['sim_wall_s']} s to simulate)")
    return res[mode], summ
