"""Figure 12: left, the TTFT breakdown against APS; right, the ablation ladder's JCT.

Left (online, the runs of figure 10): each request's TTFT split from its timeline (testbed s,
divided by the dilation) into
    queue    arrival -> the scheduler's decision (t_routed)
    alloc    decision -> the KV read starts (DRAM buffer space on the PE and DE nodes)
    read     the hit KV read from storage, queueing behind other reads included
             (t_read_start -> t_prefill_start; no read: 0)
    prefill  waiting for and running the prefill passes, up to the first token
             (t_prefill_start -> t_first_token)
The four add up to t_first_token - t_arrive. Records of runs made before the conductor recorded
its decision time have no t_routed: there queue and alloc are one span, reported as queue, and
alloc as 0 (said in the report). Means over the measured requests of each (APS, mode). The paper
(DS 660B): Basic's read time grows with APS, DualPath's stays flat.

Right (offline): the ladder basic, +layerwise, +dual-path (round-robin), +scheduler (dualpath),
and oracle, JCT relative to Basic; the paper's reductions are 17.21 %, 38.19 % and 45.62 %
(DS 660B, 64K, 1024 and 2048 agents). The ladder runs Qwen2.5-32B on 1p1d-io, where the target's
HBM does not bind (12 requests fit a Basic pass, more than its passes hold), so its +Layerwise step
is overlap alone. The first step is measured apart where HBM binds (DESIGN.md 3a): DS 660B on
1p1d-hbm, its budget over the length scale, at the paper's agents per prefill engine (1024 agents
on 2P4D's 16 prefill GPUs is 64 per engine: 128 on 1P1D's two; the full size adds 2048's 256).
"""
from __future__ import annotations

from pathlib import Path

from emulators.gpu.memory import LAYERS_IN_FLIGHT
from testbed.measure import plots
from testbed.measure.metrics import batch_sizes
from testbed.reproduce import online, paper
from testbed.reproduce.common import Headline, Result, UsedRun, jct, mean, pd_bound
from testbed.reproduce.plan import IO_1P1D_OVERRIDES, PAPER_SCALE, Plan, RunConfig, WorkloadSpec
from testbed.reproduce.spread import Draws, map_draws, mean_draws, ratio_draws, sample_ratio_draws
from testbed.topology import PAPER_MAXLEN_TOKENS

ID = "fig12"
TITLE = "TTFT breakdown against APS (left) and the ablation ladder (right)"
LADDER = ("basic", "layerwise", "dualpath-rr", "dualpath", "oracle")
PARTS = ("queue", "alloc", "read", "prefill")
PART_COLORS = {"queue": "#8c8c8c", "alloc": "#ccb974", "read": "#4c72b0", "prefill": "#c44e52"}
TOPOLOGY = "1p1d-io"
LADDER_TURNS = 2.5  # the full ladder's turn divisor (fig7's)
HBM_TOPOLOGY = "1p1d-hbm"
HBM_STEP = ("basic", "layerwise")
HBM_AGENTS = {True: (128,), False: (128, 256)}  # the paper's 1024 and 2048 agents per prefill engine


def hbm_configs(quick: bool) -> list[RunConfig]:
    """The +Layerwise step where the target's HBM binds: the demo workload (contexts up to 2,048
    tokens, the 64K MaxLen / 32) on 1p1d-hbm."""
    return [RunConfig(f"fig12/hbm/demo-{a}", HBM_TOPOLOGY, HBM_STEP, WorkloadSpec(agents=a), params={"agents": a, "hbm": True})
            for a in HBM_AGENTS[quick]]


def ladder_configs(quick: bool) -> list[RunConfig]:
    if quick:
        return [RunConfig("fig12/ladder/demo-24", TOPOLOGY, LADDER, WorkloadSpec(agents=24),
                          topology_overrides=dict(IO_1P1D_OVERRIDES), params={"agents": 24})]
    # turns / 2.5, as fig7's full size, so that the ladder and the grid fit the hour an id may take
    return [RunConfig(f"fig12/ladder/64K-{a}", TOPOLOGY, LADDER,
                      WorkloadSpec(preset="64K", scale=PAPER_SCALE, agents=a, turns_scale=LADDER_TURNS),
                      topology_overrides=dict(IO_1P1D_OVERRIDES), params={"agents": a}) for a in (12, 24)]


def plan(quick: bool = False) -> Plan:
    on = online.online_plan(ID, quick)
    grid = on.configs
    if quick:  # two points keep it under 10 min: the lowest, and the first past Basic's I/O capacity
        past = next((c for c in on.configs if c.params["aps"] > online.capacity_aps("basic")), on.configs[-1])
        grid = [on.configs[0], past]
    lad = ladder_configs(quick)
    right = ("the demo workload, 24 agents (`make demo`)" if quick else
             f"the paper's 64K trace with lengths / {PAPER_SCALE} and turns / {LADDER_TURNS:g}, 12 and 24 agents "
             "(the paper: 1024 and 2048)")
    step = (f"the first step also where HBM binds: DS 660B on 1P1D ({HBM_TOPOLOGY}), the demo workload, "
            f"{' and '.join(map(str, HBM_AGENTS[quick]))} agents")
    return Plan(ID, quick, grid + lad + hbm_configs(quick),
                scale_down=f"left: {on.scale_down}. Right: 1P1D (1p1d-io, links x{IO_1P1D_OVERRIDES['scale']:g}), "
                           f"{right}; {step}", notes=on.notes, search=None)


# --------------------------------------------------------------------------- left


def ttft_breakdown(r: dict, dilation: float = 1.0) -> dict[str, float]:
    """One request's TTFT in four parts (emulated s); they sum to (t_first_token - t_arrive) / k."""
    arrive, pstart, first = r["t_arrive"], r["t_prefill_start"], r["t_first_token"]
    rstart = r["t_read_start"] if r.get("t_read_start", 0) > 0 else pstart
    routed = r.get("t_routed")
    if routed is not None and arrive <= routed <= rstart:
        queue, alloc = routed - arrive, rstart - routed
    else:
        queue, alloc = rstart - arrive, 0.0
    return {"queue": queue / dilation, "alloc": alloc / dilation, "read": (pstart - rstart) / dilation,
            "prefill": (first - pstart) / dilation}


def measured_parts(run, mode: str) -> list[dict]:
    """The TTFT parts of each measured request of one (APS, mode) run: past the warm-up, no error."""
    recs = sorted((r for r in run.records(mode) if r.get("trajectory", 0) >= 0 and not r.get("error")),
                  key=lambda r: r["t_arrive"])
    if not recs:
        return []
    t0, t1 = recs[0]["t_arrive"], recs[-1]["t_arrive"]
    start = t0 + online.WARMUP * (t1 - t0)
    return [ttft_breakdown(r, run.dilation) for r in recs if r["t_arrive"] >= start]


def breakdown_point(run, mode: str) -> dict:
    """Mean TTFT parts of the measured requests of one (APS, mode) run."""
    parts = measured_parts(run, mode)
    if not parts:
        return {"aps": run.aps, "mode": mode, "n": 0, **{p: None for p in PARTS}}
    return {"aps": run.aps, "mode": mode, "n": len(parts),
            "split_queue_alloc": all("t_routed" in r for r in run.records(mode)),
            **{p: mean(x[p] for x in parts) for p in PARTS}}


def read_growth(runs: dict, mode: str) -> Draws:
    """Mean read time at the highest APS over the lowest, with a bootstrap over each run's requests."""
    by = sorted((r for r in online.online_runs(runs) if r.has(mode) and measured_parts(r, mode)), key=lambda r: r.aps)
    if len(by) < 2:
        return Draws(None, None, 0, "")
    return sample_ratio_draws([p["read"] for p in measured_parts(by[-1], mode)],
                              [p["read"] for p in measured_parts(by[0], mode)], "requests")


def left(runs: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {m: [] for m in online.MODES}
    for r in online.online_runs(runs):
        for m in online.MODES:
            if r.has(m):
                out[m].append(breakdown_point(r, m))
    return out


def render_left(br: dict, out: Path) -> list[str]:
    apss = sorted({p["aps"] for pts in br.values() for p in pts})
    if not apss:
        return []
    fig, ax = plots.new_figure("Figure 12 (left): TTFT breakdown against load, Qwen2.5-32B on 1P1D",
                               "load (agents per emulated second, APS)", "mean TTFT (emulated s)")
    width = 0.38
    hatches = {"basic": "", "dualpath": "///"}
    for j, m in enumerate(online.MODES):
        by = {p["aps"]: p for p in br.get(m, [])}
        for i, a in enumerate(apss):
            p = by.get(a)
            if not p or not p["n"]:
                continue
            x = i + (j - 0.5) * width
            bottom = 0.0
            for part in PARTS:
                v = p[part] or 0.0
                ax.bar(x, v, width * 0.95, bottom=bottom, color=PART_COLORS[part], hatch=hatches[m], edgecolor="white")
                bottom += v
            ax.annotate("B" if m == "basic" else "D", (x, bottom), ha="center", va="bottom", fontsize=7,
                        xytext=(0, 1), textcoords="offset points")
    for part in PARTS:
        ax.bar([0], [0], color=PART_COLORS[part], label=part)
    ax.bar([0], [0], color="white", edgecolor="#555555", label="B: Basic (solid)")
    ax.bar([0], [0], color="white", edgecolor="#555555", hatch="///", label="D: DualPath (hatched)")
    ax.set_xticks(range(len(apss)))
    ax.set_xticklabels([f"{a:g}" for a in apss])
    plots.legend(ax, loc="upper left")
    plots.caption(fig, "Paper (DS 660B): Basic's KV read time grows with APS while DualPath's stays flat.")
    plots.save(fig, out / "fig12_left.png")
    return ["fig12_left.png"]


# --------------------------------------------------------------------------- right


def right(runs: dict, quick: bool) -> list[dict]:
    """One row per ladder run (Qwen2.5-32B, `hbm` False) and per HBM-bound step (DS 660B, `hbm` True)."""
    out = []
    for cfg in ladder_configs(quick) + hbm_configs(quick):
        r = runs.get(cfg.key)
        if r is None:
            continue
        hbm = bool(cfg.params.get("hbm"))
        j = {m: jct(r, m) if r.has(m) else None for m in LADDER}
        red = {m: (1 - j[m] / j["basic"]) if j.get(m) is not None and j.get("basic") else None for m in LADDER}
        rel_ci = {m: ratio_draws((r, m), (r, "basic")).estimate().ci95 for m in LADDER if m != "basic" and r.has(m)}
        out.append({"key": cfg.key, "agents": cfg.params["agents"], "hbm": hbm,
                    "label": f"{cfg.params['agents']}, DS 660B, HBM binds" if hbm else str(cfg.params["agents"]),
                    "jct_s": j, "reduction": red, "relative_ci95": rel_ci, "bound": None if hbm else pd_bound(r),
                    "prefill_batches": {m: batch_sizes(r.passes(m)) for m in LADDER if r.has(m)}})
    return out


def hbm_room() -> str:
    """What one prefill pass of the HBM-bound cluster holds, in words, from its topology."""
    b, ctx = hbm_configs(True)[0].topology_obj().hbm_budget(), PAPER_MAXLEN_TOKENS // PAPER_SCALE
    basic, lw = (b.largest_batch_requests(ctx, whole) for whole in (True, False))
    return (f"at a {ctx:,}-token context a Basic pass holds {basic} requests, every layer of their past resident; "
            f"Layer Blocks hold {LAYERS_IN_FLIGHT} of {b.n_layers} layers at a time: {lw}")


def hbm_full_share(rows: list[dict], mode: str) -> float | None:
    """The share of `mode`'s prefill passes that HBM filled, over the HBM-bound rows."""
    bs = [c["prefill_batches"].get(mode) for c in rows if c["hbm"]]
    n = sum(b["batches"] for b in bs if b)
    return sum(b["hbm_limited"] for b in bs if b) / n if n else None


def reduction_bound(rows: list[dict]) -> float | None:
    """The most a mean reduction over the rows can be: the mean of each run's 1 - 1/bound (each
    agent count has its own bound: fewer agents, a shorter chain bound)."""
    bounds = [1 - 1 / c["bound"] for c in rows if c.get("bound")]
    return mean(bounds) if bounds and len(bounds) == len(rows) else None


def batch_note(row: dict) -> str:
    """What the ladder's prefill passes held, per mode: the +Layerwise step's batch-size evidence."""
    def one(m: str, b: dict | None) -> str:
        if not b:
            return f"{plots.label(m)} none"
        hbm = (f", HBM peak {b['hbm_peak_bytes'] / 1e9:.2f} GB, {b['hbm_limited']} of {b['batches']} passes full"
               if b.get("hbm_peak_bytes") is not None else ", no HBM record (a run from before the HBM budget)")
        tokens = f", {b['tokens']['max']:,} tokens at most" if b["tokens"]["max"] else ""
        return f"{plots.label(m)} {b['requests']['p50']}/{b['requests']['p90']}/{b['requests']['max']} requests{tokens}{hbm}"

    return (f"Right, {row['label']} agents, prefill batch sizes (p50/p90/max; HBM in target bytes): "
            + "; ".join(one(m, b) for m, b in row.get("prefill_batches", {}).items()) + ".")


def render_right(rows: list[dict], out: Path) -> list[str]:
    if not rows:
        return []
    fig, ax = plots.new_figure("Figure 12 (right): the ablation ladder, Qwen2.5-32B on 1P1D; its first step where HBM "
                               "binds, DS 660B", "agents (JCT in the bars, emulated s)", "JCT relative to Basic (1 = Basic)")
    groups = [c["label"] for c in rows]
    rel = {m: [(c["jct_s"][m] / c["jct_s"]["basic"]) if c["jct_s"][m] is not None and c["jct_s"]["basic"] else None
               for c in rows] for m in LADDER}
    bars = plots.grouped_bars(ax, groups, rel, annotate=False)
    labelled = False
    for m, bs in bars.items():
        labelled |= plots.interval_bars(ax, [b.get_x() + b.get_width() / 2 for b in bs], rel[m],
                                        [c.get("relative_ci95", {}).get(m) for c in rows],
                                        label=None if labelled else "95 % interval")
    for m, bs in bars.items():
        for b, c in zip(bs, rows):
            v = c["jct_s"][m]
            if v is not None:  # the absolute JCT inside the bar; the paper's markers sit on top
                ax.text(b.get_x() + b.get_width() / 2, b.get_height() / 2, f"{v:.0f} s", ha="center", va="center",
                        fontsize=7, rotation=90, color="white")
    n = len(LADDER)
    width = 0.8 / n
    for i, m in enumerate(LADDER):
        if m in paper.FIG12_REDUCTION:
            xs = [g + (i - (n - 1) / 2) * width for g, c in enumerate(rows) if c["jct_s"].get(m) is not None]
            plots.paper_points(ax, xs, [1 - paper.FIG12_REDUCTION[m]] * len(xs),
                               "paper (DS 660B): 1 - its mean reduction" if m == "layerwise" else None)
    for g, c in enumerate(rows):  # each agent count has its own bound (its chain): a segment over its group
        if c["bound"]:
            ax.hlines(1 / c["bound"], g - 0.45, g + 0.45, ls=":", color="#555555", lw=1.2,
                      label="least JCT each group's bound allows (1 / bound)" if g == 0 else None)
            ax.text(g + 0.45, 1 / c["bound"], f"1/{c['bound']:.2f}", fontsize=6, va="bottom", ha="right", color="#555555")
    ax.set_ylim(0, 1.35)
    plots.legend_below(ax, ncol=3)
    plots.save(fig, out / "fig12_right.png")
    return ["fig12_right.png"]


def reproduce(runs: dict, out: Path, quick: bool = False) -> Result:
    br = left(runs)
    rows = right(runs, quick)
    ladder = [c for c in rows if not c["hbm"]]

    def reduction(m: str, of: list[dict]):
        return mean_draws([map_draws(ratio_draws((runs[c["key"]], m), (runs[c["key"]], "basic")), lambda x: 1 - x)
                           for c in of if c["reduction"].get(m) is not None]).estimate()

    heads = [Headline.of("right, where HBM binds (DS 660B, 1p1d-hbm): +Layerwise mean JCT reduction vs Basic (share)",
                         reduction("layerwise", [c for c in rows if c["hbm"]]), paper.FIG12_REDUCTION["layerwise"])]
    for m in ("layerwise", "dualpath-rr", "dualpath"):
        heads.append(Headline.of(f"right: {plots.label(m)} mean JCT reduction vs Basic (share)"
                                 + (" (Qwen2.5-32B ladder, HBM does not bind)" if m == "layerwise" else ""),
                                 reduction(m, ladder), paper.FIG12_REDUCTION[m], reduction_bound(ladder)))
    for m in online.MODES:
        heads.append(Headline.of(f"left: {plots.label(m)} mean read time at the highest / lowest APS (x; paper: "
                                 f"{'grows' if m == 'basic' else 'flat, ~1'})", read_growth(runs, m).estimate()))
    used = [UsedRun(k, r, tuple(m for m in online.MODES if r.has(m))) for k, r in runs.items() if r.aps is not None]
    used += [UsedRun(c["key"], runs[c["key"]], tuple(m for m in LADDER if runs[c["key"]].has(m))) for c in rows]
    notes = ["Right: the paper's reductions are means over 1024 and 2048 agents (DS 660B, 64K); ours are means over "
             "our agent counts. Paper JCTs (read off the figure): "
             + "; ".join(f"{a} agents " + ", ".join(f"{plots.label(m)} {v}" for m, v in d.items())
                         for a, d in paper.FIG12_JCT.items()) + " s.",
             ]
    notes += [batch_note(c) for c in rows]
    full = {m: hbm_full_share(rows, m) for m in HBM_STEP}
    if any(c["hbm"] for c in rows):
        notes.append("Where HBM binds: " + ", ".join(f"{plots.label(m)} {v:.0%}" if v is not None else f"{plots.label(m)} n/a"
                                                     for m, v in full.items())
                     + f" of prefill passes were HBM-full ({hbm_room()}).")
    if quick:
        notes.append(f"Left (quick): the grid's lowest APS and the first past Basic's I/O capacity "
                     f"({online.capacity_aps('basic'):.2f} APS; DualPath's is {online.capacity_aps('dualpath'):.2f}): "
                     "there Basic's SNIC saturates and DualPath's are about half busy, the regime of the paper's "
                     "figure (Basic's queue dominates at its highest APS). The full size runs the whole grid, to "
                     "1.1x DualPath's capacity, where DualPath's reads queue too.")
    if any(not p["split_queue_alloc"] for pts in br.values() for p in pts):
        notes.append("Left: some runs' records have no t_routed (the decision time): their queue and alloc are "
                     "one span, reported as queue.")
    if not online.online_runs(runs):
        notes.insert(0, "Left panel: no online run: " + online.NO_RUNNER)
    return Result(ID, TITLE, heads, render_left(br, out) + render_right(rows, out), used,
                  data={"left": br, "right": rows, "hbm_full_share": full}, notes=notes, scale_down=plan(quick).scale_down)
