"""Figure 11: online average JCT against APS, Basic and DualPath.

An agent's JCT is its last turn's end minus its first turn's arrival (emulated). The paper
(DS 660B) reads about 575 s at 0.1 APS and 1,100 s at 0.45 APS for DualPath; Basic's grows
sharply towards its capacity. Uses the same online runs as figure 10.
"""
from __future__ import annotations

from pathlib import Path

from testbed.measure import plots
from testbed.reproduce import online
from testbed.reproduce.common import Headline, Result
from testbed.reproduce.fig10 import model_entry, model_figure, paper_models, used_of
from testbed.reproduce.fig10 import plan as fig10_plan
from testbed.reproduce.spread import sample_draws, sample_ratio_draws

ID = "fig11"
TITLE = "Online average JCT against APS"


def plan(quick: bool = False):
    """fig10's runs and simulated models, under this id."""
    from dataclasses import replace

    return replace(fig10_plan(quick), id=ID)


def render(cur: dict, caps: dict, out: Path) -> list[str]:
    if not any(cur.values()):
        return []
    fig, ax = plots.new_figure("Figure 11: mean agent JCT against load, Qwen2.5-32B on 1P1D",
                               "load (agents per emulated second, APS)", "mean JCT per agent (emulated s)")
    for m, pts in cur.items():
        plots.mode_line(ax, [p["aps"] for p in pts], [p["jct_mean"] for p in pts], m)
        over = [p for p in pts if not p["meets_slo"]]
        if over:
            ax.scatter([p["aps"] for p in over], [p["jct_mean"] for p in over], marker="x", color=plots.color(m), s=40,
                       zorder=6, label=f"{plots.label(m)}: over the SLO")
        if caps.get(m):
            ax.axvline(caps[m], ls="-.", lw=0.9, color=plots.color(m), label=f"{plots.label(m)}: highest APS under SLO")
    ax.set_ylim(bottom=0)
    return [plots.finish(fig, ax, out / "fig11.png", "Paper (DS 660B, DualPath): ~575 s at 0.1 APS, ~1,100 s at 0.45 APS; Basic's JCT grows sharply "
                       "towards its capacity. Absolute values are not comparable (scaled-down cluster and workload).", ncol=2)]


def common_point(cur: dict) -> float | None:
    """The highest APS at which both modes were run and both meet the SLO."""
    ok = [{p["aps"] for p in pts if p["meets_slo"]} for pts in cur.values()]
    both = set.intersection(*ok) if ok else set()
    return max(both) if both else None


def agent_jcts_at(runs: dict, aps: float | None) -> dict[str, list[float]]:
    """Each mode's agent JCTs (emulated s) in the run at `aps`: the units its mean, the curve's
    point there, is over."""
    run = next((r for r in online.online_runs(runs) if aps is not None and r.aps == aps), None)
    return {m: online.agent_jcts(online.requests(run, m)) if run is not None and run.has(m) else []
            for m in online.MODES}


def model_headlines(models: tuple[dict, ...]) -> list[Headline]:
    """Per simulated model: Basic's mean agent JCT over DualPath's at the highest APS both meet."""
    out = []
    for m in models:
        at = common_point(m["points"])
        jct = {mode: next((p["jct_mean"] for p in pts if p["aps"] == at), None) for mode, pts in m["points"].items()}
        r = jct["basic"] / jct["dualpath"] if at is not None and jct["basic"] and jct["dualpath"] else None
        out.append(Headline(f"{m['model']} on {m['cluster']}, simulated (each agent's last {m['keep_turns']} turns): Basic / DualPath mean JCT "
                            f"at {'the highest APS both meet' if at is None else f'{at:.3g} APS'} (x)", r, simulated=True))
    return out


def render_models(models: tuple[dict, ...], out: Path) -> list[str]:
    return model_figure(models, lambda p: p["jct_mean"], "mean JCT per agent (s, simulated)",
                        "JCTs and APS are not the paper's: each agent has fewer turns.", out / "fig11_models.png",
                        lambda ax, m: ax.set_ylim(bottom=0))


def reproduce(runs: dict, out: Path, quick: bool = False) -> Result:
    cur = online.curves(runs)
    caps = online.capacities(cur)
    at = common_point(cur)

    jcts = agent_jcts_at(runs, at)
    name = f"at {at:g} APS" if at is not None else "at the highest APS both meet the SLO"
    heads = [Headline.of(f"Basic mean JCT {name} (emulated s)", sample_draws(jcts["basic"], "agents").estimate()),
             Headline.of(f"DualPath mean JCT {name} (emulated s)", sample_draws(jcts["dualpath"], "agents").estimate()),
             Headline.of(f"Basic / DualPath mean JCT {name} (x)",
                         sample_ratio_draws(jcts["basic"], jcts["dualpath"], "agents").estimate())]
    notes = ["The paper gives no ratio for this figure; it uses it for the working set by Little's law "
             "(lambda x mean JCT x total length / 2: 69 GB at 0.1 APS to 681 GB at 0.45 APS for DS 660B)."]
    if not online.online_runs(runs):
        notes.insert(0, "No online run: " + online.NO_RUNNER)
    models = paper_models(quick)
    heads += model_headlines(models)
    return Result(ID, TITLE, heads, render(cur, caps, out) + render_models(models, out), used_of(runs),
                  data={"curves": {m: [{k: p[k] for k in ("aps", "jct_mean", "agents", "meets_slo")} for p in pts]
                                   for m, pts in cur.items()}, "capacity_aps": caps, "common_aps": at,
                        "models": [model_entry(m) for m in models]},
                  notes=notes, scale_down=plan(quick).scale_down)
