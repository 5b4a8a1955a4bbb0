"""`dualpath reproduce bounds`: the testbed's own bottleneck-free P/D range, tested by a P/D sweep.

The paper derives 1/7 <= P/D <= 7/2 (section 4.2) and never runs outside it. Here the same method
over the testbed's own links (dualpath/analysis/testbed_bounds.py) predicts, at each P/D, which
resource saturates first: inside the range the storage NICs (SNICs), below it the prefill
engines' CNIC rx, above it the decode node's host port tx. The sweep runs DualPath at five P/D
points of one base topology (topologies/1p1d-bounds.yaml: g = 1, s = 0.25, so the range is
1/3 <= P/D <= 2): 1P4D below the range, 1P2D, 2P3D and 1P1D inside it, 3P1D above it.

Measured: every resource's utilisation from the links' counters (links.jsonl, every NIC's rx and
tx bytes sampled 0.25 s apart: the bytes HTB shaped, so a resource's rate is what they are held
to), over the run's loaded window: from the moment every agent has had its first turn served
(the synchronised start is over) to the moment a quarter of the agents have finished (past it
the cluster empties). A resource's utilisation is its members' bytes over the window divided by
their rates times the window's length (the SNICs of every node together: the premise is that
they all saturate). The measured bottleneck is the most utilised resource if it carries at least
SATURATED (0.9) of its rate, else none; the point passes when it is the predicted one.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib.ticker
import numpy as np

from dualpath.analysis import method
from dualpath.analysis.bounds import paper_model
from dualpath.analysis.testbed_bounds import SNIC_RX, members
from testbed.measure import plots
from testbed.reproduce.common import MIN_LOADED, Headline, Result, UsedRun
from testbed.reproduce.plan import Plan, RunConfig, WorkloadSpec
from testbed.reproduce.spread import bootstrap_ci

ID = "bounds"
TITLE = "The testbed's own bottleneck-free P/D range, tested by a P/D sweep"
TOPOLOGY = "1p1d-bounds"
MODE = "dualpath"
SATURATED = 0.9  # a resource at or above this share of its rate is saturated (the rule)
FIRST_TURNS_DONE = 1.0  # the window opens when this share of agents has had its first turn served
ACTIVE_SHARE = 0.75  # ... and closes when fewer than this share of the agents are still running
WINDOW_S = 0.5  # emulated s: the loaded window is cut into windows this long for n and the interval
POINTS = ((1, 4), (1, 2), (2, 3), (1, 1), (3, 1))  # (P, D): one below, three inside, one above
# Half the base topology's x0.0032, twice its dilation. At x0.0032 the full size's 2P3D outran the
# host (UNFAITHFUL twice), and on 2026-12-06 four of the quick size's five points did too, on this
# code and on the code that made the FAITHFUL quick report of 2026-12-04 (1e77003), one after the
# other: the host had no margin at that dilation, whichever code ran.
LINK_SCALE = 0.0016


def sizes(quick: bool) -> tuple[int, float]:
    """(agents per node, turns divisor): enough agents per node to keep its SNIC reading
    (a turn reads for ~1/6 of its cycle, the rest is prefill and decode)."""
    # quick runs every turn too: with half of them its loaded windows held 14 to 19 windows of
    # 0.5 emulated s (2026-12-06), fewer than the 20 a per-window share needs
    return (12, 1.0) if quick else (16, 1.0)


def config(p: int, d: int, quick: bool) -> RunConfig:
    per_node, turns = sizes(quick)
    wl = WorkloadSpec(agents=per_node * (p + d), turns_scale=turns)
    over = {"name": f"{p}p{d}d-bounds", "prefill_nodes": p, "decode_nodes": d, "scale": LINK_SCALE}
    return RunConfig(f"bounds/{p}p{d}d", TOPOLOGY, (MODE,), wl, topology_overrides=over, params={"p": p, "d": d})


def plan(quick: bool = False) -> Plan:
    per_node, turns = sizes(quick)
    spec = config(1, 1, quick).topology_obj().spec
    sd = (f"P/D sweep over {', '.join(f'{p}P{d}D' for p, d in POINTS)} of {TOPOLOGY} (g = {spec.engines_per_node} "
          f"engine per node, s = {spec.snic_ratio:g}, B = {spec.cnic_gbps:g} Gbit/s in paper units, links "
          f"x{spec.scale:g}: a CNIC is {spec.cnic_gbps * spec.scale * 1000:g} Mbit/s, an SNIC "
          f"{spec.cnic_gbps * spec.snic_ratio * spec.scale * 1000:g}); the demo "
          f"workload with {per_node} agents per node" + (f", turn counts / {turns:g} (quick)" if turns != 1 else "")
          + "; DualPath (the full scheduler) only")
    return Plan(ID, quick, [config(p, d, quick) for p, d in POINTS], scale_down=sd, notes=[
        "1P4D and 3P1D leave the testbed's own range (1/3 <= P/D <= 2) on purpose; the estimates assume the "
        "storage NICs saturate, so those two take about a quarter longer"])


# --------------------------------------------------------------------------- measurement (pure)


def loaded_window(records: list[dict]) -> tuple[float, float] | None:
    """(t0, t1) testbed s since the mode's start: from when FIRST_TURNS_DONE of the agents have had
    their first turn served to when fewer than ACTIVE_SHARE are still running (see the module
    docstring); None when the run has no such span."""
    agents: dict[int, list[dict]] = {}
    for r in records:
        if r.get("trajectory", -1) >= 0 and not r.get("error"):
            agents.setdefault(r["trajectory"], []).append(r)
    if not agents:
        return None
    firsts = sorted(min(rs, key=lambda r: r.get("turn", 0))["t_done"] for rs in agents.values())
    ends = sorted(max(r["t_done"] for r in rs) for rs in agents.values())
    n = len(agents)
    t0 = firsts[max(0, math.ceil(FIRST_TURNS_DONE * n) - 1)]
    t1 = ends[min(n - 1, int(math.floor((1 - ACTIVE_SHARE) * n)))]
    return (t0, t1) if t1 > t0 else None


def nic_roles(topo) -> dict[str, tuple[str, str, float]]:
    """Every emulated NIC's name in links.jsonl ("dpt-p0e0/cnic") -> (role, kind, rate bit/s)."""
    from testbed.fabric.network import plan as fabric_plan

    return {f"{n.ns}/{n.kind}": (ep.role, n.kind, float(n.rate_bps)) for ep in fabric_plan(topo) for n in ep.nics}


def _wanted(side: str, role: str) -> bool:
    return {"all": role in ("prefill", "decode"), "pe": role == "prefill", "de": role == "decode",
            "cluster": role == "storage"}[side]


def utilizations(samples: list[dict], roles: dict[str, tuple[str, str, float]], model: method.Model,
                 window: tuple[float, float]) -> dict[str, float]:
    """Each resource's measured share of its rate over the window: its members' bytes (the
    counters interpolated at the window's edges) over their rates times the window's length."""
    samples = sorted(samples, key=lambda s: s["t"])
    if len(samples) < 2:
        return {}
    t = np.array([s["t"] for s in samples], dtype=float)
    t0, t1 = max(window[0], t[0]), min(window[1], t[-1])
    if t1 <= t0:
        return {}
    out = {}
    for res, (side, kind, direction) in members(model).items():
        col = 0 if direction == "rx" else 1
        nbytes = cap = 0.0
        for name, (role, k, rate) in roles.items():
            if k != kind or not _wanted(side, role):
                continue
            cum = np.array([s["nics"].get(name, [0, 0])[col] for s in samples], dtype=float)
            nbytes += float(np.interp(t1, t, cum) - np.interp(t0, t, cum))
            cap += rate / 8 * (t1 - t0)
        if cap > 0:
            out[res] = nbytes / cap
    return out


def measured_bottleneck(util: dict[str, float], threshold: float = SATURATED) -> str | None:
    """The most utilised resource if it carries at least `threshold` of its rate, else None."""
    if not util:
        return None
    top = max(util, key=util.get)
    return top if util[top] >= threshold else None


# --------------------------------------------------------------------------- the analysis


def point(cfg: RunConfig, run) -> dict[str, Any]:
    """One sweep point: the analysis' prediction and, with a run, what the counters measured."""
    topo = cfg.topology_obj()
    p, d = cfg.params["p"], cfg.params["d"]
    model = topo.testbed_model()
    rng = method.pd_range(model)
    row: dict[str, Any] = {
        "key": cfg.key, "p": p, "d": d, "ratio": p / d, "inside": rng.contains(p / d),
        "predicted": method.first_saturating(model, p, d),
        "predicted_utilization": _round(method.utilizations(model, p, d)),
        "expected": _round(method.expected_shares(model, p, d)),
        "measured": None, "most_utilized": None, "utilization": {}, "window_s": None, "match": False,
        "faithful": None, "windows": 0, "predicted_share_ci95": None}
    if run is None or not run.has(MODE):
        return row
    win = loaded_window(run.records(MODE))
    util = utilizations(run.links(MODE), nic_roles(topo), model, win) if win else {}
    # the most utilised resource whatever its share: it tells a link that leads but never reaches
    # SATURATED (the host set the pace) from one the analysis got wrong; the match rule ignores it
    row.update(measured=measured_bottleneck(util), most_utilized=measured_bottleneck(util, 0.0),
               utilization=_round(util), faithful=run.faithful([MODE]),
               window_s=[round(win[0], 2), round(win[1], 2)] if win else None,
               window_emulated_s=[round(run.emulated(x), 3) for x in win] if win else None)
    row["match"] = row["measured"] is not None and row["measured"] == row["predicted"]
    shares = window_shares(run.links(MODE), nic_roles(topo), model, win, row["predicted"],
                           WINDOW_S * run.dilation) if win else []
    row["windows"], row["predicted_share_ci95"] = len(shares), bootstrap_ci(shares)
    return row


def window_shares(samples: list[dict], roles: dict[str, tuple[str, str, float]], model: method.Model,
                  window: tuple[float, float], resource: str, width_s: float) -> list[float]:
    """A resource's share of its rate in each of the equal windows, about width_s testbed s long,
    the loaded window splits into: the units its share's interval and sample count are over."""
    n = int((window[1] - window[0]) // width_s)
    edges = np.linspace(window[0], window[1], n + 1) if n >= 1 else []
    shares = [utilizations(samples, roles, model, (a, b)).get(resource) for a, b in zip(edges[:-1], edges[1:])]
    return [x for x in shares if x is not None]


def _round(d: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in d.items()}


def ranges() -> dict[str, Any]:
    """The testbed's own range for the sweep's base topology, and the paper's for the same g, s, M/B."""
    topo = config(1, 1, True).topology_obj()
    s = topo.spec
    rng = method.pd_range(topo.testbed_model())
    paper = method.pd_range(paper_model(s.engines_per_node, s.snic_ratio, s.dram_gbps / s.cnic_gbps))
    return {"range": {"lower": rng.lower, "upper": rng.upper, "lower_by": list(rng.lower_by),
                      "upper_by": list(rng.upper_by), "text": method.format_range(rng),
                      "cluster_limits": [c.describe() for c in rng.cluster_limits]},
            "paper_range": {"lower": paper.lower, "upper": paper.upper, "lower_by": list(paper.lower_by),
                            "upper_by": list(paper.upper_by), "text": method.format_range(paper)},
            "model": topo.testbed_model()}


# --------------------------------------------------------------------------- plots

SHOWN = (SNIC_RX, "PE CNIC rx", "DE host port tx", "DE CNIC rx", "DE host port rx", "PE CNIC tx")
COLORS = {SNIC_RX: "#4c72b0", "PE CNIC rx": "#dd8452", "DE host port tx": "#c44e52", "DE CNIC rx": "#8172b3",
          "DE host port rx": "#937860", "PE CNIC tx": "#55a868"}


def render(rows: list[dict], rng: dict[str, Any], out: Path) -> list[str]:
    if not rows:
        return []
    pngs = []
    # 1: per point, each resource's measured share beside what the analysis expects once the first saturates
    labels = [f"{r['p']}P{r['d']}D\n(P/D {method.ratio_str(r['ratio'])})" for r in rows]
    fig, ax = plots.new_figure("Measured utilisation per resource at each P/D point", "sweep point",
                               "share of the resource's rate (loaded window)", size=(7.6, 4.4))
    n = len(SHOWN)
    width = 0.8 / n
    for i, res in enumerate(SHOWN):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(rows))]
        ax.bar(xs, [r["utilization"].get(res, 0.0) for r in rows], width * 0.95, color=COLORS[res], label=res)
        ax.scatter(xs, [r["expected"].get(res, 0.0) for r in rows], marker="_", s=120, color="black", zorder=5,
                   label="expected by the analysis" if i == 0 else None)
    for g, r in enumerate(rows):
        verdict = "ok" if r["match"] else "MISMATCH"
        ax.annotate(f"predicted: {r['predicted']}\nmeasured: {r['measured'] or 'none >= 0.9'}\n{verdict}",
                    (g, 1.08), ha="center", va="bottom", fontsize=6)
    ax.axhline(SATURATED, ls="--", lw=1, color="#555555", label=f"saturated ({SATURATED:g} of the rate)")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels)
    ax.set_ylim(0, 1.35)
    pngs.append(plots.finish(fig, ax, out / "bounds_utilization.png",
                             f"Testbed's own range: {rng['range']['text']}; the paper's for the same g, s, M: "
                             f"{rng['paper_range']['text']}. Bars: measured; ticks: the analysis' expected share "
                             "once the first resource saturates and throttles every flow alike.", ncol=3))
    # 2: against P/D, the analysis' curves and the measured points
    model = rng["model"]
    fig, ax = plots.new_figure("Utilisation against P/D: the analysis (lines) and the sweep (markers)",
                               "P/D (log scale)", "share of the resource's rate", size=(7.0, 4.4))
    xs = np.logspace(math.log10(0.15), math.log10(5), 200)
    for res in SHOWN[:4]:
        ax.plot(xs, [method.expected_shares(model, x, 1.0)[res] for x in xs], color=COLORS[res], lw=1.2, label=res)
        ax.scatter([r["ratio"] for r in rows if res in r["utilization"]],
                   [r["utilization"][res] for r in rows if res in r["utilization"]], color=COLORS[res], zorder=5)
    lo, hi = rng["range"]["lower"], rng["range"]["upper"]
    ax.axvspan(lo, hi, color="#4c72b0", alpha=0.08, label=f"testbed's own range [{method.ratio_str(lo)}, "
                                                          f"{method.ratio_str(hi)}]")
    ax.axhline(SATURATED, ls="--", lw=1, color="#555555", label=f"saturated ({SATURATED:g})")
    ax.set_xscale("log")
    ticks = sorted({0.25, 0.5, 1.0, 2.0, 4.0, lo, hi, *(r["ratio"] for r in rows)})
    ax.set_xticks(ticks, [method.ratio_str(x) for x in ticks])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_ylim(0, 1.15)
    pngs.append(plots.finish(fig, ax, out / "bounds_vs_pd.png",
                             "Lines: each resource's share of its rate once the first one saturates (the paper's "
                             "method over the testbed's links, hit KV only); markers: measured over each run's loaded "
                             "window.", ncol=3))
    return pngs


# --------------------------------------------------------------------------- the reproduction


def reproduce(runs: dict, out: Path, quick: bool = False) -> Result:
    rng = ranges()
    cfgs = plan(quick).configs
    rows = [point(c, runs.get(c.key)) for c in cfgs]
    done = [r for r in rows if r["measured"] is not None or r["utilization"]]
    heads = [Headline("testbed's own lower bound on P/D", rng["range"]["lower"], rng["paper_range"]["lower"], None),
             Headline("testbed's own upper bound on P/D", rng["range"]["upper"], rng["paper_range"]["upper"], None)]
    for r in rows:
        share = r["utilization"].get(r["predicted"])
        ci = r.get("predicted_share_ci95")
        heads.append(Headline(f"{r['p']}P{r['d']}D ({'inside' if r['inside'] else 'outside'}): predicted "
                              f"{r['predicted']}, share of its rate", share, None, r["expected"][r["predicted"]],
                              n=r.get("windows") or None, ci95=ci,
                              ci_method=f"bootstrap over the loaded window's {WINDOW_S:g} emulated s windows" if ci else None))
    heads.append(Headline("points whose measured bottleneck is the predicted one", sum(r["match"] for r in rows),
                          None, len(rows), n=len(done)))
    heads.append(Headline("points whose most utilised resource (any share) is the predicted one",
                          sum(r["most_utilized"] == r["predicted"] for r in rows), None, len(rows), n=len(done)))
    used = [UsedRun(c.key, runs[c.key], (MODE,)) for c in cfgs if c.key in runs and runs[c.key].has(MODE)]
    notes = [
        f"Testbed's own range: {rng['range']['text']}; cluster size: "
        f"{'; '.join(rng['range']['cluster_limits']) or 'no limit'}. The paper's method over the testbed's links "
        "(dualpath/analysis/testbed_bounds.py): an H2D is one crossing (host port tx, CNIC rx), the PE's WRITE "
        "lands on the DE host port, and the host port shapes each direction apart, so the bounds are not the paper's.",
        f"The paper's range for the same g, s and M/B (PCIe reads and writes, DRAM): {rng['paper_range']['text']}.",
        f"Measured bottleneck: the most utilised resource if at least {SATURATED:g} of its rate over the loaded window "
        "(from every agent's first turn served to a quarter of the agents finished), else none.",
        "Utilisation counts every byte HTB shaped (headers, miss KV, write-back, control), the analysis hit KV only: "
        "the measured shares of the non-bottleneck links sit a few percent above the expected ones.",
    ]
    short = [r for r in rows if r["measured"] is None and r["most_utilized"] == r["predicted"]]
    if short:
        why = ("those runs are FAITHFUL, so the host did not set the pace: the load did not keep the link busy"
               if all(r["faithful"] for r in short) else
               "an UNFAITHFUL run's host, not its links, may have set the pace")
        where = ", ".join(f"{r['p']}P{r['d']}D" for r in short)
        notes.insert(0, f"At {where} the predicted resource is "
                        f"the most utilised but stays under {SATURATED:g} of its rate ({why}). Those points do not "
                        "match.")
    if len(done) < len(rows):
        notes.insert(0, f"{len(rows) - len(done)} of {len(rows)} points have no run: nothing measured there.")
    sections = ["## The sweep", "", "| P | D | P/D | inside | predicted | measured | match | most utilised | "
                + " | ".join(SHOWN) + " |", "|" + " --- |" * (8 + len(SHOWN))]
    for r in rows:
        cells = [f"{r['utilization'][x]:.2f} ({r['expected'][x]:.2f})" if x in r["utilization"] else "—"
                 for x in SHOWN]
        sections.append(f"| {r['p']} | {r['d']} | {method.ratio_str(r['ratio'])} | {'yes' if r['inside'] else 'no'} | "
                        f"{r['predicted']} | {r['measured'] or 'none'} | {'yes' if r['match'] else 'NO'} | "
                        f"{r['most_utilized'] or '—'} | " + " | ".join(cells) + " |")
    sections += ["", "Each cell: measured share of the rate (the analysis' expected share in brackets)."]
    data = {"range": {k: rng["range"][k] for k in ("lower", "upper", "lower_by", "upper_by", "cluster_limits")},
            "paper_range": {k: rng["paper_range"][k] for k in ("lower", "upper", "lower_by", "upper_by")},
            "saturated_share": SATURATED, "mode": MODE,
            "points": [{k: r[k] for k in ("p", "d", "inside", "predicted", "measured", "most_utilized", "utilization",
                                          "expected", "predicted_utilization", "match", "window_s", "windows",
                                          "predicted_share_ci95", "faithful", "key")}
                       for r in rows],
            "all_match": bool(rows) and all(r["match"] for r in rows)}
    return Result(ID, TITLE, heads, render(done, rng, out), used, data=data, notes=notes,
                  scale_down=plan(quick).scale_down, sections=sections,
                  shortfalls=[f"{r['p']}P{r['d']}D: its loaded window holds {r['windows']} windows of {WINDOW_S:g} "
                              f"emulated s, fewer than {MIN_LOADED}" for r in done if r.get("windows", 0) < MIN_LOADED])
