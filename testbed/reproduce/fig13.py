"""Figure 13: storage-NIC traffic max/avg over time, round-robin against the scheduler.

From links.jsonl (every NIC's cumulative bytes, sampled 0.25 s apart): per time window of
WINDOW_S emulated seconds, the bytes each storage NIC received (its reads from storage, the
counters interpolated at the window's edges), and max/avg across the storage NICs (1 = perfect
balance, the bound). The paper measures during the high-load phase; here a window is loaded
when the storage NICs together carried at least LOAD_SHARE of their combined rate in it.
Headline: the mean of the ratios of the loaded windows, pooled over the run's seeds, with a
bootstrap interval over those windows (the paper: 1.53 round-robin, 1.18 scheduled; the issue
asks <= 1.15 and >= 1.4). Fewer than MIN_LOADED loaded windows: not a result.
The run: the README's scheduler experiment (2p1d-io, each agent's first turn 1,024 cold tokens),
on 3 workloads at --quick (POOLS_SEEDS).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from testbed.measure import plots
from testbed.reproduce import paper
from testbed.reproduce.common import MIN_LOADED, Headline, Result, UsedRun, mean, replicas
from testbed.reproduce.spread import loaded_mean, t_interval
from testbed.reproduce.plan import Plan, RunConfig, WorkloadSpec

ID = "fig13"
TITLE = "Storage NIC traffic max/avg over time: round-robin vs the scheduler"
WINDOW_S = 0.5  # emulated seconds per window (1 s gave 10 to 14 loaded windows per run; 20 are needed)
POOLS_SEEDS = True
QUICK_SEEDS = 3
LOAD_SHARE = 0.5
TOPOLOGY = "2p1d-io"
# Half the topology's link scale, so twice its dilation: in the cold burst all four PE engines
# compute full 300 ms chunks at once, and at x0.002 each needs ~0.6 of its window in CPU; four on
# two cores overran (3-4 of ~223 passes, up to 260 ms late: UNFAITHFUL). At x0.001 they need ~0.3.
LINK_SCALE = 0.001


def scheduler_config(quick: bool) -> RunConfig:
    """The README's scheduler experiment; figure 14 reads the same run."""
    modes = ("dualpath-rr", "dualpath") if quick else ("dualpath-rr", "dualpath", "dualpath-split")
    agents = 24 if quick else 48
    return RunConfig(f"scheduler/2p1d-io/{agents}", TOPOLOGY, modes, WorkloadSpec(agents=agents, first_turn_tokens=1024),
                     topology_overrides={"scale": LINK_SCALE}, params={"agents": agents})


def plan(quick: bool = False) -> Plan:
    cfg = scheduler_config(quick)
    plan_ = Plan(ID, quick, [cfg], scale_down=(
        f"2P1D (2p1d-io: three nodes, one 20 Gbit/s storage NIC each, s = 0.05, links x{LINK_SCALE:g}; the paper: three "
        f"machines); the demo workload with {cfg.workload.agents} agents whose first turn appends 1,024 cold tokens "
        "(a compute burst at the start, as in the README's scheduler experiment)"))
    return plan_.with_seeds(QUICK_SEEDS if quick else 1)


def snic_series(samples: list[dict], dilation: float, window_s: float = WINDOW_S) -> list[dict]:
    """Per window (emulated s): its middle t, each storage NIC's received bytes, total, max/avg."""
    samples = sorted(samples, key=lambda s: s["t"])
    nics = sorted({n for s in samples for n in s.get("nics", {}) if n.endswith("/snic")})
    if len(samples) < 2 or not nics:
        return []
    t = np.array([s["t"] for s in samples], dtype=float) / dilation
    cum = {n: np.array([s["nics"].get(n, [0, 0])[0] for s in samples], dtype=float) for n in nics}
    edges = np.arange(t[0], t[-1] + 1e-9, window_s)
    out = []
    for a, b in zip(edges[:-1], edges[1:]):
        per = {n: float(np.interp(b, t, cum[n]) - np.interp(a, t, cum[n])) for n in nics}
        tot = sum(per.values())
        avg = tot / len(per)
        out.append({"t": float((a + b) / 2), "t0": float(a), "t1": float(b), "bytes": per, "total": tot,
                    "max_over_avg": (max(per.values()) / avg) if avg > 0 else None})
    return out


def mark_loaded(series: list[dict], capacity_Bps: float | None, window_s: float = WINDOW_S,
                share: float = LOAD_SHARE) -> list[dict]:
    """The series as the points the figure draws, {t, value, loaded, total}: loaded when the storage
    NICs together carried >= share of their combined capacity (bytes per emulated second) in the
    window. Without a known capacity (runs from before the rates were recorded), of the busiest
    window's total."""
    cap = capacity_Bps * window_s if capacity_Bps else max((w["total"] for w in series), default=0.0)
    return [{"t": w["t"], "value": w["max_over_avg"], "total": w["total"],
             "loaded": bool(cap) and w["total"] >= share * cap and w["max_over_avg"] is not None} for w in series]


def run_points(run, mode: str, window_s: float = WINDOW_S) -> tuple[list[dict], float | None]:
    """One run's points and its storage-NIC bytes max/avg summed over its loaded windows."""
    ser = snic_series(run.links(mode), run.dilation, window_s)
    rates = run.snic_rates_bps(mode) if run.has(mode) else {}
    # a NIC counter counts wire bytes; rate in bit/s of the testbed; per emulated second: x dilation
    pts = mark_loaded(ser, sum(rates.values()) / 8 * run.dilation if rates else None, window_s)
    tot: dict[str, float] = {}
    for w, p in zip(ser, pts):
        if p["loaded"]:
            for n, v in w["bytes"].items():
                tot[n] = tot.get(n, 0.0) + v
    whole = (max(tot.values()) / (sum(tot.values()) / len(tot))) if tot and sum(tot.values()) else None
    return pts, whole


def pooled(runs: list, mode: str, points, window_s: float) -> dict:
    """Figures 13 and 14: `points(run)` (one run's window points) over every run (seed) that has the
    mode, tagged with the run's index; the headline from all of them, per-seed means, the share."""
    have = [r for r in runs if r.has(mode)]
    series, per_run = [], []
    for i, r in enumerate(have):
        pts = points(r)
        series += [{**p, "run": i} for p in pts]
        per_run.append(loaded_mean(pts).value)
    est = loaded_mean(series)
    return {"mode": mode, "series": series, "headline": est, "loaded_windows": est.n, "windows": len(series),
            "loaded_share": loaded_share(series, have, mode, window_s),
            "per_run_mean": per_run, "per_run_ci95": t_interval(per_run)}


def balance(runs: list, mode: str, window_s: float = WINDOW_S) -> dict:
    """The mode's points over every run (seed) that has it, and the headline computed from them."""
    whole = [run_points(r, mode, window_s)[1] for r in runs if r.has(mode)]
    return {**pooled(runs, mode, lambda r: run_points(r, mode, window_s)[0], window_s),
            "loaded_bytes_max_over_avg": mean(whole), "per_run_loaded_bytes_max_over_avg": whole}


def loaded_share(series: list[dict], runs: list, mode: str, window_s: float) -> float | None:
    """The loaded windows' time over the runs' own length (their JCTs, emulated): how much of the
    run the headline stands for (the issue asks at least half)."""
    total = sum(r.jct(mode) for r in runs if r.mode(mode).get("jct_s"))
    return sum(p["loaded"] for p in series) * window_s / total if total else None


def draw_windows(ax, series: dict[str, list[dict]]) -> None:
    """Each mode's per-window ratio, one line per run (seed), its loaded windows as dots: exactly the
    points the headline averages (loaded_mean)."""
    for m, pts in series.items():
        for i in sorted({p["run"] for p in pts}):
            mine = [p for p in pts if p["run"] == i]
            ax.plot([p["t"] for p in mine], [p["value"] for p in mine], color=plots.color(m), lw=0.8,
                    alpha=1.0 if i == 0 else 0.5, label=plots.label(m) if i == 0 else None)
        lo = [p for p in pts if p["loaded"]]
        ax.scatter([p["t"] for p in lo], [p["value"] for p in lo], color=plots.color(m), s=10, zorder=5,
                   label=f"{plots.label(m)}: loaded windows ({len(lo)})")


def ylim_for(series: dict[str, list[dict]], low: float, floor_top: float) -> tuple[float, float]:
    top = max((p["value"] or 0 for pts in series.values() for p in pts), default=floor_top)
    return low, max(floor_top, top * 1.05)


def render(series: dict[str, list[dict]], out: Path) -> list[str]:
    if not any(series.values()):
        return []
    fig, ax = plots.new_figure("Figure 13: storage NIC load balance over time (2P1D, three storage NICs)",
                               "time since the start (emulated s)", f"max / avg of storage NIC bytes per {WINDOW_S:g} s window")
    draw_windows(ax, series)
    for m, v in paper.FIG13.items():
        if m in series:
            plots.paper_hline(ax, v, f"paper, {plots.label(m)}: {v}", color_=plots.color(m))
    ax.axhline(1.0, color="black", lw=0.8, label="bound: perfect balance (1)")
    ax.set_ylim(*ylim_for(series, 0.9, 2.0))
    return [plots.finish(fig, ax, out / "fig13.png", f"One line per workload seed; dots: loaded windows (storage NICs "
                         f"together at >= {LOAD_SHARE:.0%} of their rate). The headline is the mean over the dots.",
                         ncol=2)]


def headlines(bal: dict[str, dict], modes, name: str, paper_of) -> list[Headline]:
    """Per mode: the mean over loaded windows with its n and bootstrap interval."""
    out = []
    for m in modes:
        e = bal[m]["headline"] if m in bal else None
        out.append(Headline.of(f"{plots.label(m)}: {name}", e, paper_of(m), 1.0))
    return out


def shortfalls(bal: dict[str, dict]) -> list[str]:
    """Modes whose headline rests on fewer than MIN_LOADED loaded windows."""
    return [f"{plots.label(m)}: {b['loaded_windows']} loaded windows, fewer than {MIN_LOADED}"
            for m, b in bal.items() if b["loaded_windows"] < MIN_LOADED]


def balance_data(bal: dict[str, dict], **extra) -> dict:
    """The summary's keys: series and loaded_windows per mode (what the PNG draws), the rest per mode."""
    return {"series": {m: b["series"] for m, b in bal.items()},
            "loaded_windows": {m: b["loaded_windows"] for m, b in bal.items()},
            "modes": {m: {k: v for k, v in b.items() if k not in ("series", "headline")} for m, b in bal.items()},
            **extra}


def seed_notes(bal: dict[str, dict], what: str) -> list[str]:
    """How much of the runs was loaded, and the headline per seed with a t-interval over seeds."""
    out = [f"{plots.label(m)}: {b['loaded_windows']} of {b['windows']} windows loaded"
           + (f", {b['loaded_share']:.0%} of the runs' JCT" if b["loaded_share"] is not None else "")
           + ("; under half: the loaded phase is not most of the run" if (b["loaded_share"] or 0) < 0.5 else "") + "."
           for m, b in bal.items() if b["windows"]]
    for m, b in bal.items():
        if len(b["per_run_mean"]) > 1:
            ci = b["per_run_ci95"]
            vals = ", ".join("—" if v is None else f"{v:.3f}" for v in b["per_run_mean"])
            out.append(f"{plots.label(m)}: {what} per seed {vals}" + (f"; t-interval over the seeds "
                       f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "") + ". Windows of one run are serially "
                       "correlated, so the bootstrap over windows is the narrower of the two.")
    return out


def reproduce(runs: dict, out: Path, quick: bool = False) -> Result:
    cfg = scheduler_config(quick)
    reps = replicas(runs, cfg.key)
    bal = {m: balance([r for _, r in reps], m) for m in cfg.modes if any(r.has(m) for _, r in reps)}
    heads = headlines(bal, cfg.modes, "storage NIC max/avg, mean over the loaded windows", paper.FIG13.get)
    heads += [Headline(f"{plots.label(m)}: storage NIC bytes max/avg over all loaded windows (mean over seeds)",
                       b["loaded_bytes_max_over_avg"], None, 1.0, n=len(b["per_run_mean"]),
                       ci95=t_interval(b["per_run_loaded_bytes_max_over_avg"]), ci_method="t-interval over seeds")
              for m, b in bal.items()]
    used = [UsedRun(k, r, tuple(m for m in bal if r.has(m))) for k, r in reps]
    notes = [f"Window {WINDOW_S:g} emulated s; a storage NIC's traffic is what it received (its reads). The paper "
             "measures 'within a small time window' during the high-load phase and calls the ratio meaningless once "
             "traffic is sparse; the loaded windows stand for that phase.",
             "Shape to reach (issue 11): the scheduler <= 1.15, round-robin >= 1.4 over the loaded windows."]
    notes += seed_notes(bal, "mean over loaded windows")
    empty = [m for m, b in bal.items() if not b["series"]]
    if empty:
        notes.insert(0, f"No storage NIC series for {', '.join(empty)}: the run has no links.jsonl samples of them "
                        "(runs made before the monitor's samples were kept have none).")
    return Result(ID, TITLE, heads, render({m: b["series"] for m, b in bal.items()}, out), used,
                  data=balance_data(bal, window_s=WINDOW_S, load_share=LOAD_SHARE), notes=notes,
                  scale_down=plan(quick).scale_down, shortfalls=shortfalls(bal))

