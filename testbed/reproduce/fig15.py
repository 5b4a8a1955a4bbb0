"""Figure 15: 48P96D offline over time, simulated: prompt tokens per second (hit and miss, the
article's reading of the paper's Prompt TPS) and TTFT of the requests by when they arrived.
The paper: Prompt TPS steady at about 6e7 tokens/s between 900 and 2,400 s; TTFT about 27 s at
the start, then 10 to 13 s. Our agents are fewer and shorter (testbed.reproduce.scale), so the
curves' shape (a start-up peak of TTFT, then a plateau) is what compares, not their values."""
from __future__ import annotations

from functools import partial
from pathlib import Path

from testbed.measure import plots
from testbed.reproduce import scale
from testbed.reproduce.common import Headline, Result
from testbed.reproduce.plan import Plan

Simulated = partial(Headline, simulated=True)  # every number here is the simulator's, never the testbed's

ID = "fig15"
TITLE = "48P96D offline over time (simulated): prompt TPS and TTFT"
BINS = 40


def plan(quick: bool = False) -> Plan:
    n = scale.AGENTS_PER_PE_NODE[quick]
    return Plan(ID, quick, [], scale_down=f"simulated (no testbed run); {n} agents per prefill node (the paper: 1,000), "
                                         "the demo workload per agent; see testbed/reproduce/scale.py")


def series(res) -> dict:
    recs = [r for r in res.records if r.token_times]
    t0 = res.t0  # the run starts once every group's leader has reported
    w = (max(r.t_done for r in recs) - t0) / BINS
    tps = [0.0] * BINS
    ttft: list[list[float]] = [[] for _ in range(BINS)]
    for r in recs:
        tps[min(BINS - 1, int((r.t_first_token - t0) / w))] += r.n_prompt / w
        ttft[min(BINS - 1, int((r.t_arrive - t0) / w))].append(r.t_first_token - r.t_arrive)
    mid = [(i + 0.5) * w for i in range(BINS)]
    return {"t_s": mid, "prompt_tps": tps, "ttft_mean_s": [sum(x) / len(x) if x else None for x in ttft]}


def reproduce(runs: dict, out: Path, quick: bool = False) -> Result:
    res, summ = scale.run_one("48p96d", quick)
    s = series(res)
    fig, ax = plots.new_figure("Figure 15 (simulated): 48P96D offline", "time (simulated s)", "prompt tokens per second")
    ax.plot(s["t_s"], s["prompt_tps"], color=plots.color("dualpath"), label="prompt TPS (hit + miss)")
    ax2 = ax.twinx()
    xs = [t for t, v in zip(s["t_s"], s["ttft_mean_s"]) if v is not None]
    ax2.plot(xs, [v for v in s["ttft_mean_s"] if v is not None], color="#c44e52", ls="--", label="TTFT (by arrival)")
    ax2.set_ylabel("TTFT (s)")
    ax.legend(loc="upper left", fontsize=7)
    ax2.legend(loc="upper right", fontsize=7)
    plots.caption(fig, f"{summ['agents']} agents ({scale.AGENTS_PER_PE_NODE[quick]} per prefill node; the paper 1,000), "
                       "demo workload; DualPath mode. Compare the shape with the paper's, not the values.")
    plots.save(fig, out / "fig15.png")
    mid = [v for v in s["prompt_tps"][BINS // 4: 3 * BINS // 4]]
    steady = sum(mid) / len(mid) if mid else None
    tt = [v for v in s["ttft_mean_s"] if v is not None]
    heads = [Simulated("steady prompt TPS, middle half of the run (tokens/s; paper ~6e7 at 48K agents)", steady, 6e7),
             Simulated("TTFT of the first arrivals (s; paper ~27)", tt[0] if tt else None, 27.0),
             Simulated("TTFT median over arrival bins (s; paper 10-13)", sorted(tt)[len(tt) // 2] if tt else None, None),
             Simulated("scheduler cores at the cluster's speed (paper: below 10)", summ["scheduler"]["cores_at_cluster_speed"], 10.0)]
    return Result(ID, TITLE, heads, ["fig15.png"], data={"series": s, "summary": summ},
                  notes=[f"Paper: {scale.SOURCE}.", f"Simulated in {summ['sim_wall_s']} s."],
                  scale_down=plan(quick).scale_down, no_runs_needed=True)
