"""Figure 10: online serving. TTFT, TTST and TPOT against APS, Basic and DualPath.

Agents arrive as a Poisson process at a given APS (agents per emulated second). Per APS and
mode: the mean (line) and p10-p90 (band) of each latency over the measured requests, and
whether the run meets the SLO (TTFT <= 4 s, TPOT <= 50 ms) in steady state
(testbed.reproduce.online). As in the paper, TTST and TPOT points of runs over the SLO are left
out. The headline is the highest APS meeting the SLO per mode and their ratio: the paper reports
1.67x (DS 27B) and 2.25x (DS 660B); the bound on 1P1D is (P+D)/P = 2.
"""
from __future__ import annotations

from pathlib import Path

from testbed.measure import plots
from testbed.reproduce import online, paper
from testbed.reproduce.common import Headline, Result, UsedRun, pd_bound, ratio

ID = "fig10"
TITLE = "Online serving: TTFT, TTST and TPOT against APS"
METRICS = (("ttft", "TTFT (emulated s)", paper.SLO_TTFT_S, 1.0), ("ttst", "TTST (emulated s)", None, 1.0),
           ("tpot", "TPOT (emulated ms)", paper.SLO_TPOT_S, 1e3))


def plan(quick: bool = False):
    return online.online_plan(ID, quick)


def used_of(runs: dict) -> list[UsedRun]:
    return [UsedRun(k, r, tuple(m for m in online.MODES if r.has(m))) for k, r in runs.items() if r.aps is not None]


def render(cur: dict, caps: dict, out: Path) -> list[str]:
    pngs = []
    if not any(cur.values()):
        return pngs
    for key, ylabel, slo, scale in METRICS:
        fig, ax = plots.new_figure(f"Figure 10: {key.upper()} against load, Qwen2.5-32B on 1P1D",
                                   "load (agents per emulated second, APS)", ylabel)
        for m, pts in cur.items():
            keep = [p for p in pts if key == "ttft" or p["meets_slo"]]  # the paper omits points over the SLO
            xs = [p["aps"] for p in keep]
            ys = [None if p[key]["mean"] is None else p[key]["mean"] * scale for p in keep]
            lo = [None if p[key]["p10"] is None else p[key]["p10"] * scale for p in keep]
            hi = [None if p[key]["p90"] is None else p[key]["p90"] * scale for p in keep]
            plots.mode_line(ax, xs, ys, m, band=(lo, hi))
            if caps.get(m):
                ax.axvline(caps[m], ls="-.", lw=0.9, color=plots.color(m), label=f"{plots.label(m)}: highest APS under SLO")
        ax.set_ylim(bottom=0)
        if slo is not None:
            plots.slo_hline(ax, slo * scale, f"SLO ({slo * scale:g} {'s' if scale == 1 else 'ms'})")
            ax.set_ylim(0, max(ax.get_ylim()[1], slo * scale * 1.15))
        pngs.append(plots.finish(fig, ax, out / f"fig10_{key}.png", f"Lines: mean over the measured requests; bands: p10-p90. Paper: DualPath's highest APS "
                           f"under the SLO is {paper.FIG10_CAPACITY_RATIO['DS 27B']}x Basic's (DS 27B) and "
                           f"{paper.FIG10_CAPACITY_RATIO['DS 660B']}x (DS 660B).", ncol=2))
    return pngs


def reproduce(runs: dict, out: Path, quick: bool = False) -> Result:
    cur = online.curves(runs)
    caps = online.capacities(cur)
    ons = online.online_runs(runs)
    bound = next((pd_bound(r) for r in ons if pd_bound(r)), 2.0)
    open_ended = online.unbracketed(cur)

    def cap_name(m: str, label: str) -> str:
        return f"{label}: highest APS under the SLO (agents per emulated s{'; a lower bound' if m in open_ended else ''})"

    # the ratio of two capacities is a measurement only when basic's is bracketed (dualpath's
    # lower bound over basic's true capacity is still a lower bound of the ratio)
    cap_ratio = ratio(caps.get("dualpath"), caps.get("basic")) if "basic" not in open_ended else None
    heads = [Headline(cap_name("basic", "Basic"), caps.get("basic"), None, None),
             Headline(cap_name("dualpath", "DualPath"), caps.get("dualpath"), None, None),
             Headline("DualPath / Basic highest APS under the SLO (x; paper DS 660B: 2.25"
                      f"{'; a lower bound' if cap_ratio is not None and 'dualpath' in open_ended else ''})",
                      cap_ratio, paper.FIG10_CAPACITY_RATIO["DS 27B"], bound)]
    notes = ["Paper: the highest APS under the SLO, Basic vs DualPath: DS 27B 0.3 vs 0.5 (1.67x, 1P1D), DS 660B 0.2 "
             "vs 0.45 (2.25x, 2P4D); the issue asks for >= 1.6x on 1p1d-io, whose bound is 2x.",
             "The absolute APS is not comparable to the paper's: the cluster and the workload are scaled down.",
             "The SLO verdict uses the steady-state rule of testbed.reproduce.online (the paper's, scaled)."]
    for m in [m for m in cur if cur[m] and m not in open_ended and caps.get(m) is not None]:
        fail = min((p for p in cur[m] if not p["meets_slo"] and p["aps"] > caps[m]), key=lambda p: p["aps"])
        notes.append(f"{m}: met the SLO at {caps[m]:.3g} APS and failed at {fail['aps']:.3g}: "
                     + "; ".join(fail["verdict"]["reasons"]) + ".")
    for m in open_ended:
        top = max(cur[m], key=lambda p: p["aps"])
        notes.insert(0, f"{m}: every probed APS met the SLO, up to {top['aps']:g}, so its highest APS under the "
                        f"SLO is not found{'' if m != 'basic' else ' and the ratio is not measured'}: more "
                        f"probes are needed above it (mean TTFT there {top['ttft']['mean']:.3g} s, mean "
                        f"JCT {top['jct_mean']:.3g} s).")
    if not ons:
        notes.insert(0, "No online run: " + online.NO_RUNNER)
    return Result(ID, TITLE, heads, render(cur, caps, out), used_of(runs),
                  data={"curves": cur, "capacity_aps": caps, "capacity_is_lower_bound": open_ended},
                  notes=notes, scale_down=plan(quick).scale_down)
