"""Figure 14: attention-time max/avg across the prefill engines over time.

The paper's engines of a data-parallel group step together (the EP AllToAll syncs them), so it
compares their attention time per forward step. The testbed's engines pass independently, so
the documented equivalent is per time window of WINDOW_S emulated seconds: each PE's attention
time in the window (every pass's emulated attention time, prorated by its overlap with the
window), max/avg across the PEs. A window counts as loaded when every PE was in a pass for at
least LOAD_SHARE of it (the paper measures while the engines are loaded, its first 5 %).
Headline: the mean ratio over the loaded windows, pooled over the run's seeds, with a bootstrap
interval over them (the paper: 1.06; the issue asks <= 1.1). Fewer than MIN_LOADED: not a result.

Its own run, not figure 13's: figure 13's workload is I/O-bound on purpose, and there the PEs
computed in under a fifth of each window after the cold burst, so one window was loaded. Here
every turn appends APPEND_SCALE x the demo's tokens, so the PEs' compute, not the storage NICs,
is what they wait on. Links at x0.0008 (LINK_SCALE): four engines computing without pause
with 320 agents queued took both cores at figure 13's x0.001 (stopped mid-run); 160 agents at
x0.0005 were FAITHFUL with the CPU 33 % busy, but took 5 minutes per mode. At x64 a context reaches MaxLen after its first turn or two, so the run is
one long burst of cold prefills, its length set by the agents: at x8 with 48 agents (the old
size) the PEs were loaded for 3 or 4 windows of a 13 s run and waited on reads for the rest.
The pairing of each engine's k-th pass is kept as a secondary series (attention_series).
"""
from __future__ import annotations

from pathlib import Path

from testbed.measure import plots
from testbed.reproduce import paper
from testbed.reproduce.common import Headline, Result, UsedRun, mean, replicas
from testbed.reproduce.spread import bootstrap_ci
from testbed.reproduce.fig13 import (QUICK_SEEDS, TOPOLOGY, balance_data, draw_windows, headlines, pooled,
                                     seed_notes, shortfalls, ylim_for)
from testbed.reproduce.plan import Plan, RunConfig, WorkloadSpec

ID = "fig14"
TITLE = "Attention time max/avg across prefill engines over time"
WINDOW_S = 0.5  # emulated seconds per window: about two full 300 ms passes
LOAD_SHARE = 0.5  # a window is loaded when every PE was in a pass for this share of it
APPEND_SCALE = 64.0
# Meant to shorten the run's tail after the burst (8 loaded windows of 23 per run): it did not
# (JCT 11.6 -> 11.4 s). The tail is not decode (1.5 tokens a request at x0.25) but the write-back
# of the burst's new KV through the storage NICs: a request's last token to its done took 6.7 s.
GEN_SCALE = 0.25
LINK_SCALE = 0.0008
POOLS_SEEDS = True
# One full-size run left 15 (DualPath) and 18 (round-robin) loaded windows, under DESIGN 9's 20: the
# loaded phase is the cold burst, whatever comes after it. Two workloads, pooled, gave 30 and 32,
# measured rather than stretched by a workload sized to reach the count.
FULL_SEEDS = 2


def balance_config(quick: bool) -> RunConfig:
    modes = ("dualpath-rr", "dualpath")
    agents = 96 if quick else 288  # 160 agents kept the PEs busy 18.7 emulated s: about 11 (34) s, 22 (68) windows
    return RunConfig(f"balance/2p1d-io/{agents}", TOPOLOGY, modes,
                     WorkloadSpec(agents=agents, first_turn_tokens=1024, append_scale=APPEND_SCALE,
                                  gen_scale=GEN_SCALE),
                     topology_overrides={"scale": LINK_SCALE}, params={"agents": agents})


def plan(quick: bool = False) -> Plan:
    cfg, seeds = balance_config(quick), QUICK_SEEDS if quick else FULL_SEEDS
    plan_ = Plan(ID, quick, [cfg], scale_down=(
        f"2P1D (2p1d-io: 2 PE nodes x 2 engines = 4 prefill engines in one group, links x{LINK_SCALE:g}; the paper: "
        f"one PE group of a 2P4D cluster); the demo workload with {cfg.workload.agents} agents, 1,024-token cold "
        f"first turns, every append x{APPEND_SCALE:g}, so that the PEs are compute-loaded (a context reaches "
        f"MaxLen in a turn or two: one long burst of prefills, the paper's loaded start), and generations "
        f"x{GEN_SCALE:g}; the loaded phase is that burst, less than half of the run (the notes give its share): "
        f"the rest is the write-back of the burst's new KV through the storage NICs; {seeds} workloads (seeds), "
        f"their loaded windows pooled"))
    return plan_.with_seeds(seeds)


def attention_windows(passes: list[dict], dilation: float, window_s: float = WINDOW_S,
                      share: float = LOAD_SHARE) -> list[dict]:
    """Per window (emulated s): each PE's attention time (prorated), max/avg, its busy shares, loaded."""
    pes = sorted({b["pe"] for b in passes})
    if len(pes) < 2:
        return []
    span = [(b["pe"], b["t_start"] / dilation, b["t_end"] / dilation, float(b["attention_s"])) for b in passes]
    t0, t1 = min(s for _, s, _, _ in span), max(e for _, _, e, _ in span)
    out, a = [], t0
    while a < t1 - 1e-9:
        b = a + window_s
        att = dict.fromkeys(pes, 0.0)
        busy = dict.fromkeys(pes, 0.0)
        for pe, s, e, x in span:
            ov = min(b, e) - max(a, s)
            if ov > 0:
                att[pe] += x * ov / (e - s) if e > s else x
                busy[pe] += ov
        avg = sum(att.values()) / len(att)
        out.append({"t": a + window_s / 2, "t0": a, "t1": b, "attention": att,
                    "max_over_avg": max(att.values()) / avg if avg > 0 else None,
                    "min_busy_share": min(busy.values()) / window_s,
                    "loaded": all(v >= share * window_s for v in busy.values())})
        a = b
    return out


def attention_series(passes: list[dict], dilation: float, key: str = "attention_s") -> list[dict]:
    """Per forward step (each PE's k-th pass): step, t (emulated s, mean start), max/avg, loaded."""
    per: dict[str, list[dict]] = {}
    for b in sorted(passes, key=lambda b: b["t_start"]):
        per.setdefault(b["pe"], []).append(b)
    if len(per) < 2:
        return []
    out = []
    for k in range(min(len(v) for v in per.values())):
        step = [v[k] for v in per.values()]
        vals = [float(b[key]) for b in step]
        avg = sum(vals) / len(vals)
        out.append({"step": k, "t": sum(b["t_start"] for b in step) / len(step) / dilation,
                    "max_over_avg": (max(vals) / avg) if avg > 0 else None, "loaded": all(b.get("loaded") for b in step),
                    "pes": len(step)})
    return out


def window_points(run, mode: str) -> list[dict]:
    """One run's attention windows as the points the figure draws."""
    return [{"t": w["t"], "value": w["max_over_avg"], "loaded": w["loaded"] and w["max_over_avg"] is not None,
             "min_busy_share": w["min_busy_share"]} for w in attention_windows(run.passes(mode), run.dilation)]


def balance(runs: list, mode: str) -> dict:
    """The mode's window points over every run (seed) that has it, the headline from them, and the
    k-th-pass pairing as a secondary number."""
    steps = [s for r in runs if r.has(mode) for s in attention_series(r.passes(mode), r.dilation)]
    step_in = [s["max_over_avg"] for s in steps if s["loaded"] and s["max_over_avg"] is not None]
    return {**pooled(runs, mode, lambda r: window_points(r, mode), WINDOW_S),
            "per_step": {"mean_over_loaded_steps": mean(step_in), "loaded_steps": len(step_in), "steps": len(steps),
                         "ci95": bootstrap_ci(step_in)}}


def render(series: dict[str, list[dict]], out: Path) -> list[str]:
    if not any(series.values()):
        return []
    fig, ax = plots.new_figure("Figure 14: attention time balance across prefill engines (one group of 4)",
                               "time since the start (emulated s)",
                               f"max / avg attention time per {WINDOW_S:g} s window")
    draw_windows(ax, series)
    plots.paper_hline(ax, paper.FIG14, f"paper (DualPath, first 5 % of the task): {paper.FIG14}")
    ax.axhline(1.0, color="black", lw=0.8, label="bound: perfect balance (1)")
    ax.set_ylim(*ylim_for(series, 0.95, 1.6))
    return [plots.finish(fig, ax, out / "fig14.png",
                         f"Each PE's attention time per window (passes prorated by overlap), one line per workload "
                         f"seed; dots: windows in which every engine was in a pass >= {LOAD_SHARE:.0%} of the time. "
                         "The headline is the mean over the dots.", ncol=2)]


def reproduce(runs: dict, out: Path, quick: bool = False) -> Result:
    cfg = balance_config(quick)
    reps = replicas(runs, cfg.key)
    bal = {m: balance([r for _, r in reps], m) for m in cfg.modes if any(r.has(m) for _, r in reps)}
    heads = headlines(bal, cfg.modes, "attention max/avg across PEs, mean over loaded windows",
                      lambda m: paper.FIG14 if m == "dualpath" else None)
    heads += [Headline(f"{plots.label(m)}: attention max/avg per k-th pass, mean over loaded steps (secondary)",
                       b["per_step"]["mean_over_loaded_steps"], None, 1.0, n=b["per_step"]["loaded_steps"],
                       ci95=b["per_step"]["ci95"], ci_method="bootstrap over loaded steps (2,000 resamples)")
              for m, b in bal.items()]
    used = [UsedRun(k, r, tuple(m for m in bal if r.has(m))) for k, r in reps]
    notes = ["Attention time is each pass's emulated time (the target's). A pass's time is capped by the 300 ms compute "
             "quota, so a loaded engine's passes are near the cap in every mode; round-robin is shown beside the "
             "scheduler.",
             f"Window {WINDOW_S:g} emulated s; loaded: every PE in a pass for >= {LOAD_SHARE:.0%} of the window.",
             "Shape to reach (issue 11): <= 1.1 over the loaded windows (the paper: 1.06)."]
    notes += seed_notes(bal, "mean over loaded windows")
    empty = [m for m, b in bal.items() if not b["series"]]
    if empty:
        notes.insert(0, f"No forward passes for {', '.join(empty)}: the run has no passes.jsonl of them, or fewer than "
                        "two prefill engines.")
    return Result(ID, TITLE, heads, render({m: b["series"] for m, b in bal.items()}, out), used,
                  data=balance_data(bal, window_s=WINDOW_S, load_share=LOAD_SHARE), notes=notes,
                  scale_down=plan(quick).scale_down, shortfalls=shortfalls(bal))
