"""The simulated scale runs shared by table3 and fig15 (DESIGN.md section 9): the paper's 2P4D,
48P96D and 44P88D clusters (topologies/sim/) serving its model, DS 660B (DeepSeek-V3.2 on H800),
in the target's own time, the simulator uncalibrated (no testbed host: latencies of the target's
links and GPUs only).

The paper's load, and what is scaled down (issue 38, item 5):
* agents: the paper's AGENTS_PER_PE_NODE = 1,000 per prefill node (2K on 2P4D, 48K on 48P96D;
  Table 3), so that every engine's queue is as deep as the paper's;
* lengths: the 64K trace set at the paper's lengths (scale 1; dualpath.workload presets);
* turns: TURNS turns of each agent, not its whole trajectory. The paper's offline run is 3,201 s
  of the target's time, about 60 turns per agent, millions of requests at 48P96D; the simulator
  does a few hundred requests per wall second at this size (every pull of the one PE group
  gathers its 384 engines' reports). So each agent joins its trajectory at a seeded uniform turn,
  its earlier context in the store (its first request reads it back, as any later turn does):
  the agents' contexts are spread over their trajectories as in the paper's steady phase (its
  900 to 2,400 s), and every agent arrives at once, its turns queueing behind the others'. The
  JCTs are of these few turns, not comparable with the paper's; TTFT and prompt throughput are.

48P96D carries 24 copies of 2P4D's agents (replicate), so that perfectly linear scaling keeps the
JCT exactly (independent draws would grow the makespan with their tail). Offline, every agent
starts at a seeded uniform offset in [0, START_STAGGER_S) target seconds (stagger), in every
cluster alike: exact copies started in the same instant stay in lockstep, each turn then reaching
the scheduler as a burst of `copies` identical requests, which no trace of independent agents
produces (in lockstep `dualpath reproduce table3` gave a JCT ratio of 1.197 at e374668).
Online, 2P4D is offered 60 % of the agents per second it served offline, and 44P88D 22x that.
"""
from __future__ import annotations

import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from dualpath.workload import WorkloadConfig, poisson_arrivals
from dualpath.workload.spec import WorkloadSpec
from simulator.agents import TrajectorySpec
from testbed.sim.drive import SimResult, sim_config, simulate, trajectories, summarize
from testbed.topology import Topology

SIM_TOPOLOGIES = Path(__file__).resolve().parents[2] / "topologies" / "sim"
MODEL = "deepseek-v3.2"  # the paper's Table 3 and Figure 15 (DS 660B on 2P4D and up)
PRESET = "64K"  # the trace set, at the paper's lengths
AGENTS_PER_PE_NODE = 1000  # the paper's: 2K agents on 2P4D, 48K on 48P96D
TURNS = {False: 2, True: 1}  # each agent's first turns: full, --quick (see the docstring)
BASE_PREFILL_NODES = 2  # 2P4D: every cluster's agents are copies of its agents
START_STAGGER_S = 0.02  # offline start offsets, target seconds (see the docstring)
ONLINE_LOAD = 0.6  # 2P4D's offered APS as a share of its offline throughput
PE_GROUPS = "one"  # every PE in one group, as the testbed runs them (testbed.sim.drive.sim_config)
PAPER = {"offline": {"2p4d-paper": {"agents": 2000, "jct_s": 3167.0}, "48p96d": {"agents": 48000, "jct_s": 3201.0}},
         "online": {"2p4d-paper": {"aps": 0.4, "ttft_s": 1.739}, "44p88d": {"aps": 8.8, "ttft_s": 1.847}},
         "scheduler_cores_below": 10.0}
SOURCE = "shared/reference/dualpath-paper-notes.txt (Large-Scale Scalability) and the article, section 5.5"


def scale_down(quick: bool) -> str:
    """What table3 and fig15 run instead of the paper's whole offline run, in one line."""
    t = TURNS[quick]
    return (f"simulated (no testbed run): DS 660B, the paper's {AGENTS_PER_PE_NODE:,} agents per prefill node and the "
            f"{PRESET} set's lengths, {t} turn{'s' if t > 1 else ''} per agent from a seeded point of its trajectory "
            "(its earlier context stored); see testbed/reproduce/scale.py")


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


def topology(name: str, model: str = MODEL) -> Topology:
    """topologies/sim/NAME.yaml serving `model` on H800s."""
    return _serving(SIM_TOPOLOGIES / f"{name}.yaml", model)


def paper_cluster(prefill_nodes: int, decode_nodes: int, model: str) -> Topology:
    """The paper's nodes (2p4d-paper.yaml: 8 H800s with a 400 Gbit/s CNIC each, one 400 Gbit/s
    SNIC per node, a storage tier wider than the SNICs) as a PxD cluster serving `model`: the
    paper's DS 660B on 2P4D, DS 27B on 1P1D and Qwen2.5-32B on 1P2D."""
    return _serving(SIM_TOPOLOGIES / "2p4d-paper.yaml", model, prefill_nodes, decode_nodes)


def _serving(path: Path, model: str, prefill_nodes: int | None = None, decode_nodes: int | None = None) -> Topology:
    import yaml

    from testbed.topology import parse_topology

    raw = yaml.safe_load(path.read_text())
    p, d = prefill_nodes or raw["prefill_nodes"], decode_nodes or raw["decode_nodes"]
    resized = (p, d) != (raw["prefill_nodes"], raw["decode_nodes"])
    raw.update(name=f"{p}p{d}d-paper-{model}" if resized else raw["name"], prefill_nodes=p, decode_nodes=d,
               target={"gpu": "h800", "model": model})
    return parse_topology(raw, source=f"{path} as {p}P{d}D of {model}", carried=False)


def paper_agents(n: int, turns: int, dilation: float, seed: int = 0) -> tuple[list[TrajectorySpec], WorkloadConfig]:
    """`n` agents of the PRESET trace set at the paper's lengths, each joining its trajectory at a
    seeded uniform turn with the context before it stored, for `turns` turns, all starting at 0;
    and the workload they were drawn from."""
    wcfg = WorkloadSpec(preset=PRESET, scale=1, agents=n, seed=seed).config()
    rng = random.Random(seed)
    return [t.joined_at(rng.randrange(len(t.turns)), turns) for t in trajectories(wcfg, dilation)], wcfg


def run_one(name: str, quick: bool, aps: float | None = None, progress: Callable[[str], None] = print,
            mode: str = "dualpath") -> tuple[SimResult, dict[str, Any]]:
    """One cluster, one mode: the raw result and its summary.json entry."""
    topo = topology(name)
    copies = topo.spec.prefill_nodes / BASE_PREFILL_NODES
    if copies != int(copies):
        raise ValueError(f"{name}: {topo.spec.prefill_nodes} prefill nodes is not a multiple of {BASE_PREFILL_NODES}")
    cfg = sim_config(topo, units="target", pe_groups=PE_GROUPS)
    base, wcfg = paper_agents(AGENTS_PER_PE_NODE * BASE_PREFILL_NODES, TURNS[quick], cfg.dilation)
    trajs = replicate(base, int(copies))
    n = len(trajs)
    wcfg = replace(wcfg, n_trajectories=n)
    if aps:  # the Poisson process over every agent, as the testbed's online runs draw it
        arr = poisson_arrivals(n, aps, 0)
        trajs = [replace(t, arrival_s=a * cfg.dilation) for t, a in zip(trajs, arr)]
    else:
        trajs = stagger(trajs, START_STAGGER_S * cfg.dilation)
    t = time.perf_counter()
    res = simulate(cfg, trajs, [mode])
    summ = summarize(res, cfg, topo, wcfg, "target")["modes"][mode]
    wall = time.perf_counter() - t
    summ["agents"], summ["aps"], summ["sim_wall_s"] = n, aps, round(wall, 1)
    summ["requests_per_wall_s"] = round(summ["requests"] / wall)
    progress(f"  {name}: {n} agents{f' at {aps:.4g} APS' if aps else ''}: JCT {summ['jct_s']:.4g} s, TTFT p50 "
             f"{summ['ttft_s']['p50']}, scheduler {summ['scheduler']['cores_at_cluster_speed']} cores "
             f"({summ['sim_wall_s']} s to simulate, {summ['requests_per_wall_s']} requests per second)")
    return res[mode], summ
