"""Figure 13: storage-NIC traffic max/avg over time, round-robin against the scheduler.

From links.jsonl (every NIC's cumulative bytes, sampled 0.25 s apart): per time window of
WINDOW_S emulated seconds, the bytes each storage NIC received (its reads from storage, the
counters interpolated at the window's edges), and max/avg across the storage NICs (1 = perfect
balance, the bound). The paper measures during the high-load phase; here the loaded window is
the span from the first to the last window whose storage NICs together carried at least
LOAD_SHARE of their combined rate (of the busiest window's total if none did). Headline: the
mean of the per-window ratios over the loaded window (the paper: 1.53 round-robin, 1.18
scheduled; the issue asks <= 1.15 and >= 1.4).
The run: the README's scheduler experiment (2p1d-io, each agent's first turn 1,024 cold tokens).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from testbed.measure import plots
from testbed.reproduce import paper
from testbed.reproduce.common import Headline, Result, UsedRun, mean, median
from testbed.reproduce.plan import Plan, RunConfig, WorkloadSpec

ID = "fig13"
TITLE = "Storage NIC traffic max/avg over time: round-robin vs the scheduler"
WINDOW_S = 1.0  # emulated seconds per window
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
    return Plan(ID, quick, [cfg], scale_down=(
        f"2P1D (2p1d-io: three nodes, one 20 Gbit/s storage NIC each, s = 0.05, links x{LINK_SCALE:g}; the paper: three "
        f"machines); the demo workload with {cfg.workload.agents} agents whose first turn appends 1,024 cold tokens "
        "(a compute burst at the start, as in the README's scheduler experiment)"))


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


def loaded_window(series: list[dict], capacity_Bps: float | None, window_s: float = WINDOW_S,
                  share: float = LOAD_SHARE) -> tuple[float, float] | None:
    """(start, end) emulated s: first to last window carrying >= share of the storage NICs'
    combined capacity (bytes per emulated second), or, if none does (or the capacity is not
    known), of the busiest window's total."""
    if not series:
        return None
    busiest = max(w["total"] for w in series)
    for cap in ([capacity_Bps * window_s] if capacity_Bps else []) + [busiest]:
        hot = [w for w in series if w["total"] >= share * cap and w["max_over_avg"] is not None]
        if hot:  # never that loaded at the NICs' rate: the busiest window's stands in
            return hot[0]["t0"], hot[-1]["t1"]
    return None


def balance(run, mode: str, window_s: float = WINDOW_S) -> dict:
    """The mode's series, loaded window and the ratio's mean/median/max over it."""
    ser = snic_series(run.links(mode), run.dilation, window_s)
    rates = run.snic_rates_bps(mode) if run.has(mode) else {}
    # a NIC counter counts wire bytes; rate in bit/s of the testbed; per emulated second: x dilation
    cap = sum(rates.values()) / 8 * run.dilation if rates else None
    win = loaded_window(ser, cap, window_s)
    inside = [w["max_over_avg"] for w in ser if win and w["t0"] >= win[0] and w["t1"] <= win[1]
              and w["max_over_avg"] is not None]
    tot = {}
    for w in ser:
        if win and w["t0"] >= win[0] and w["t1"] <= win[1]:
            for n, v in w["bytes"].items():
                tot[n] = tot.get(n, 0.0) + v
    whole = (max(tot.values()) / (sum(tot.values()) / len(tot))) if tot and sum(tot.values()) else None
    return {"mode": mode, "series": ser, "loaded_window": win, "mean": mean(inside), "median": median(inside),
            "max": max(inside) if inside else None, "windows": len(inside), "loaded_bytes_max_over_avg": whole,
            "nics": sorted(tot)}


def render(bal: dict[str, dict], out: Path) -> list[str]:
    if not any(b["series"] for b in bal.values()):
        return []
    fig, ax = plots.new_figure("Figure 13: storage NIC load balance over time (2P1D, three storage NICs)",
                               "time since the start (emulated s)", f"max / avg of storage NIC bytes per {WINDOW_S:g} s window")
    for m, b in bal.items():
        xs = [w["t"] for w in b["series"]]
        plots.mode_line(ax, xs, [w["max_over_avg"] for w in b["series"]], m, marker=".", lw=1)
        if b["loaded_window"]:
            ax.axvspan(*b["loaded_window"], color=plots.color(m), alpha=0.07)
    for m, v in paper.FIG13.items():
        if m in bal:
            plots.paper_hline(ax, v, f"paper, {plots.label(m)}: {v}", color_=plots.color(m))
    ax.axhline(1.0, color="black", lw=0.8, label="bound: perfect balance (1)")
    ax.set_ylim(0.9, max(2.0, max((w["max_over_avg"] or 0 for b in bal.values() for w in b["series"]), default=2) * 1.05))
    return [plots.finish(fig, ax, out / "fig13.png", f"Shaded: each mode's loaded window (storage NICs together at >= {LOAD_SHARE:.0%} of their rate); "
                       "the headline is the mean ratio over it.", ncol=2)]


def reproduce(runs: dict, out: Path, quick: bool = False) -> Result:
    cfg = scheduler_config(quick)
    r = runs.get(cfg.key)
    bal = {m: balance(r, m) for m in cfg.modes if r is not None and r.has(m)}
    heads = [Headline(f"{plots.label(m)}: storage NIC max/avg, mean over the loaded window", bal[m]["mean"] if m in bal else None,
                      paper.FIG13.get(m), 1.0) for m in cfg.modes]
    heads += [Headline(f"{plots.label(m)}: storage NIC bytes max/avg over the whole loaded window",
                       bal[m]["loaded_bytes_max_over_avg"], None, 1.0) for m in bal]
    used = [UsedRun(cfg.key, r, tuple(bal))] if r is not None else []
    notes = [f"Window {WINDOW_S:g} emulated s; a storage NIC's traffic is what it received (its reads). The paper "
             "measures 'within a small time window' during the high-load phase and calls the ratio meaningless once "
             "traffic is sparse; the loaded window stands for that phase.",
             "Shape to reach (issue 11): the scheduler <= 1.15, round-robin >= 1.4 over the loaded window."]
    empty = [m for m, b in bal.items() if not b["series"]]
    if empty:
        notes.insert(0, f"No storage NIC series for {', '.join(empty)}: the run has no links.jsonl samples of them "
                        "(runs made before the monitor's samples were kept have none).")
    data = {"modes": {m: {k: v for k, v in b.items()} for m, b in bal.items()}, "window_s": WINDOW_S,
            "load_share": LOAD_SHARE}
    return Result(ID, TITLE, heads, render(bal, out), used, data=data, notes=notes, scale_down=plan(quick).scale_down)
