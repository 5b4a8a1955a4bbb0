"""Figure 7: offline JCT of Basic, DualPath and Oracle over agent count x MaxLen.

The paper: one row per model (DS 27B 1P1D, DS 660B 2P4D, Qwen 32B 1P2D), one column per MaxLen
(32K, 48K, 64K), bars per system over the agent count. The testbed emulates one target
(Qwen2.5-32B on H800) on the I/O-bound 1P1D (1p1d-io), so it draws one row: one panel per MaxLen,
the paper's trace sets with lengths / 32 and agent counts scaled to a 4-engine cluster. Each
panel's bars are emulated JCTs; above each group, DualPath's speed-up over Basic and its bound.
"""
from __future__ import annotations

from pathlib import Path

from testbed.measure import plots
from testbed.reproduce import paper, paper_rows
from testbed.reproduce import projection as projection_
from testbed.reproduce.common import Headline, Result, UsedRun, jct, pd_bound, ratio
from testbed.reproduce.plan import IO_1P1D_OVERRIDES, PAPER_SCALE, Plan, RunConfig, WorkloadSpec
from testbed.reproduce.spread import ci_text, jct_draws, speedup_draws

ID = "fig7"
TITLE = "Offline JCT of Basic, DualPath and Oracle over agents x MaxLen"
MODES = ("basic", "dualpath", "oracle")
TOPOLOGY = "1p1d-io"
TESTBED_MODEL = "Qwen2.5-32B"  # the testbed's target (1p1d-io: Qwen2.5-32B on H800)


def grid(quick: bool) -> tuple[tuple[str, ...], tuple[int, ...], float]:
    """(MaxLen sets, agent counts, turns divisor)."""
    # quick: one panel, a quarter of the turns. The paper's cells are storage-bound (hundreds of
    # agents): at 16 agents and a third of the turns the longest agent's chain bounded DualPath
    # (1.25x, the simulator too); 32 agents with a quarter of the turns take about as long and
    # leave the storage NICs the bound of both modes (the simulator: 1.55x). Full: every panel,
    # turns / 2.5 so that the nine runs fit the hour an id may take here (--plan: 50 min; with
    # every turn, 126 min); the report's projection gives the last panel at every turn, simulated
    return (("64K",), (4, 32), 4.0) if quick else (("32K", "48K", "64K"), (8, 16, 32), 2.5)


def plan(quick: bool = False) -> Plan:
    sets, agents, turns = grid(quick)
    cfgs = [RunConfig(f"fig7/{s}/agents={a}", TOPOLOGY, MODES,
                      WorkloadSpec(preset=s, scale=PAPER_SCALE, agents=a, turns_scale=turns),
                      topology_overrides=dict(IO_1P1D_OVERRIDES), params={"max_len": s, "agents": a})
            for s in sets for a in agents]
    sd = (f"1P1D (1p1d-io: g = 2 engines per node, links x{IO_1P1D_OVERRIDES['scale']:g}, storage NIC s = 0.075); "
          f"the paper's trace sets "
          f"with lengths / {PAPER_SCALE}; agents {', '.join(map(str, agents))} (the paper: 256-4096 on 8-GPU nodes)")
    if turns != 1:
        sd += f"; turn counts / {turns:g}" + (" (quick)" if quick else " (the hour an id may take here)")
    return Plan(ID, quick, cfgs, scale_down=sd)


def cells(runs: dict, quick: bool) -> list[dict]:
    """One row per (MaxLen, agents) with a run: JCT per mode, speed-up, bound."""
    out = []
    for cfg in plan(quick).configs:
        r = runs.get(cfg.key)
        if r is None:
            continue
        j = {m: jct(r, m) for m in MODES}
        out.append({"key": cfg.key, **cfg.params, "model": TESTBED_MODEL, "cluster": "1P1D (1p1d-io)",
                    "maxlen": cfg.params["max_len"], "source": "testbed",
                    "jct_s": j, "speedup": ratio(j["basic"], j["dualpath"]),
                    "speedup_ci95": speedup_draws(r).estimate().ci95,
                    "dualpath_over_oracle": ratio(j["dualpath"], j["oracle"]), "bound": pd_bound(r),
                    "faithful": r.faithful([m for m in MODES if r.has(m)])})
    return out


def render(rows: list[dict], out: Path, quick: bool) -> list[str]:
    sets, agents, _ = grid(quick)
    pngs = []
    for s in sets:
        mine = {c["agents"]: c for c in rows if c["max_len"] == s}
        if not mine:
            continue
        groups = [a for a in agents if a in mine]
        fig, ax = plots.new_figure(f"Figure 7: offline JCT, MaxLen {s} (lengths /{PAPER_SCALE}), Qwen2.5-32B on 1P1D",
                                   "agents", "JCT (emulated s)")
        plots.grouped_bars(ax, [str(a) for a in groups], {m: [mine[a]["jct_s"][m] for a in groups] for m in MODES},
                           value_fmt="{:.0f}")
        top = max((v for a in groups for v in mine[a]["jct_s"].values() if v is not None), default=1.0)
        for i, a in enumerate(groups):
            c = mine[a]
            if c["speedup"] is not None:
                b = f", bound {c['bound']:.2f}x" if c["bound"] else ""
                pv = f" (paper {paper.FIG7_SPEEDUP_MAX['DS 27B (1P1D)']}x)" if (s, a) == (sets[-1], agents[-1]) else ""
                ax.annotate(f"{c['speedup']:.2f}x{ci_text(c['speedup_ci95'])}{pv}{b}", (i, top * 1.12), ha="center",
                            fontsize=7,
                            color=plots.color("dualpath"))
        ax.set_ylim(0, top * 1.25)
        plots.legend_below(ax, ncol=3)
        plots.caption(fig, f"Above each group: DualPath's speed-up over Basic [its 95 % interval, a bootstrap over agents] and its bound (the least of (P+D)/P, Basic/Oracle and the agents' chain). "
                           f"Paper, largest cell: {paper.FIG7_SPEEDUP_MAX['DS 27B (1P1D)']}x (DS 27B, 1P1D, 64K), "
                           f"{paper.FIG7_SPEEDUP_MAX['DS 660B (2P4D)']}x (DS 660B, 2P4D).")
        name = f"fig7_{s}.png"
        plots.save(fig, out / name)
        pngs.append(name)
    return pngs


# The last panel at its full turn counts, in the simulator (testbed.reproduce.projection). A quick
# run has a quarter of the turns and at most 32 agents, so each agent's chain of turns, not the
# storage NICs, bounds part of its JCT; the paper's cells have hundreds of agents.
PROJECTION_AGENTS = (16, 32, 64)
CALIBRATION = projection_.CALIBRATION


def projection(rows: list[dict], quick: bool) -> dict | None:
    """Simulated JCTs and speed-ups of the last panel at full turn counts, and the simulator on the
    testbed's own largest cell to judge them by; None without the calibration file."""
    cal = projection_.calibration(CALIBRATION)
    if cal is None:
        return None
    sets, agents, turns = grid(quick)
    panel = sets[-1]

    def sim(n: int, turns_scale: float) -> dict:
        cfg = RunConfig(f"fig7/projection/{panel}/agents={n}", TOPOLOGY, MODES,
                        WorkloadSpec(preset=panel, scale=PAPER_SCALE, agents=n, turns_scale=turns_scale),
                        topology_overrides=dict(IO_1P1D_OVERRIDES))
        r = projection_.simulate_config(cfg, cal)
        return {"agents": n, "turns_scale": turns_scale, **r, "speedup": ratio(r["jct_s"]["basic"], r["jct_s"]["dualpath"])}

    top = next((c for c in rows if (c["max_len"], c["agents"]) == (panel, agents[-1])), None)
    check = None
    if top is not None:
        mine = sim(agents[-1], turns)
        check = {"agents": agents[-1], "turns_scale": turns, "testbed": {"jct_s": top["jct_s"], "speedup": top["speedup"]},
                 "sim": {"jct_s": mine["jct_s"], "speedup": mine["speedup"]}}
    # the full size runs its own agent counts at every turn: only the larger ones are projected
    beyond = [n for n in PROJECTION_AGENTS if turns != 1.0 or n not in agents]
    return {"max_len": panel, "calibration": CALIBRATION.name, "check": check, "cells": [sim(n, 1.0) for n in beyond]}


def projection_section(pj: dict) -> str:
    c = pj["check"]
    judge = ""
    if c is not None:
        t, s = c["testbed"], c["sim"]
        judge = (f" On the testbed's own cell ({c['agents']} agents, turns / {c['turns_scale']:g}) the simulator gives "
                 f"a speed-up of {s['speedup']:.3g}x against the testbed's {t['speedup']:.3g}x (JCTs: "
                 + ", ".join(f"{plots.label(m)} {s['jct_s'][m]:.3g} s against {t['jct_s'][m]:.3g} s" for m in MODES) + ").")
    rows = [f"| {x['agents']} | {x['jct_s']['basic']:.3g} | {x['jct_s']['dualpath']:.3g} | {x['jct_s']['oracle']:.3g} | "
            f"{x['speedup']:.3g} | {x['testbed_s'] / 3600:.1f} h |" for x in pj["cells"]]
    why = "" if c is None else (" More agents than the testbed ran." if c["turns_scale"] == 1.0 else
                                f" The quick runs have 1/{c['turns_scale']:g} of the turns and few agents, so an "
                                "agent's chain of turns, not the storage NICs, bounds part of their JCT.")
    return "\n".join([
        f"## Projection: MaxLen {pj['max_len']} at its full turn counts, simulated", "",
        f"Not a testbed result: `simulator` with `simulator/{pj['calibration']}`, the same 1P1D and trace "
        f"(lengths / {PAPER_SCALE}) with every turn.{why}{judge} The paper's largest cell: "
        f"{paper.FIG7_SPEEDUP_MAX['DS 27B (1P1D)']}x (DS 27B, 1P1D).", "",
        "| agents | Basic JCT (emulated s) | DualPath JCT | Oracle JCT | DualPath speed-up (x) | testbed time of the three modes |",
        "| --- | --- | --- | --- | --- | --- |", *rows])


def reproduce(runs: dict, out: Path, quick: bool = False) -> Result:
    rows = cells(runs, quick)
    heads = []
    sets, agents, _ = grid(quick)
    largest = (sets[-1], agents[-1])
    for c in rows:
        r = runs[c["key"]]
        is_top = (c["max_len"], c["agents"]) == largest
        heads.append(Headline.of(f"MaxLen {c['max_len']}, {c['agents']} agents: DualPath speed-up over Basic (x)",
                                 speedup_draws(r).estimate(), paper.FIG7_SPEEDUP_MAX["DS 27B (1P1D)"] if is_top else None,
                                 c["bound"]))
        if is_top:
            heads.append(Headline.of(f"MaxLen {c['max_len']}, {c['agents']} agents: DualPath JCT / Oracle JCT (x; "
                                     f"paper DS 27B 1P1D: {paper.FIG7_DS27B_DUALPATH_OVER_ORACLE[0]}-"
                                     f"{paper.FIG7_DS27B_DUALPATH_OVER_ORACLE[1]})",
                                     speedup_draws(r, "dualpath", "oracle").estimate(), None, 1.0))
            for m in MODES:
                heads.append(Headline.of(f"MaxLen {c['max_len']}, {c['agents']} agents: {plots.label(m)} JCT "
                                         "(emulated s)", jct_draws(r, m).estimate() if r.has(m) else None))
    used = [UsedRun(c["key"], runs[c["key"]], tuple(m for m in MODES if runs[c["key"]].has(m))) for c in rows]
    notes = ["The paper's value for the largest cell is DS 27B on 1P1D (the paper's configuration closest to ours: "
             "1P1D, a model smaller than DS 660B); the testbed's target is Qwen2.5-32B, whose 256 KiB of KV per token "
             "makes it the most I/O-bound of the paper's three.",
             "Paper, DS 660B 64K (read off the figure): "
             + "; ".join(f"{a} agents Basic {b} s, DualPath {d} s" + (f", Oracle {o} s" if o else "")
                         for a, (b, d, o) in paper.FIG7_DS660B_64K.items()) + ".",
             "Shape to reach: DualPath below Basic in every cell, approaching Oracle; the speed-up grows with agents "
             "and MaxLen and stays at or under its bound."]
    pj = projection(rows, quick)  # a section and summary.json's "projection", never a headline
    sim = paper_rows.grid(quick, progress=lambda _m: None) if PAPER_GRID else []
    val = paper_rows.validation()
    pngs = render(rows, out, quick) + render_grid(rows, sim, out)
    sections = ([projection_section(pj)] if pj else []) + ([grid_section(sim, val, quick)] if sim else [])
    return Result(ID, TITLE, heads, pngs, used, data={"cells": rows + sim, "sim_validation": val, "projection": pj},
                  notes=notes, scale_down=plan(quick).scale_down, sections=sections)


# The paper's nine panels (three models by three MaxLens): the testbed's own cells, and the rest
# simulated on the paper's clusters (testbed.reproduce.paper_rows); off in tests that need speed.
PAPER_GRID = True


def render_grid(rows: list[dict], sim: list[dict], out: Path) -> list[str]:
    """The paper's 3 x 3 grid: per panel, each cell's speed-up over Basic, by its source."""
    if not sim:
        return []
    import matplotlib.pyplot as plt

    models = [r.label for r in paper_rows.PAPER_ROWS]
    fig, axes = plt.subplots(len(models), len(paper_rows.MAXLENS), figsize=(11, 8.5), sharey=True, squeeze=False)
    for i, model in enumerate(models):
        for j, maxlen in enumerate(paper_rows.MAXLENS):
            ax = axes[i][j]
            mine = [c for c in rows + sim if c["model"] == model and c["maxlen"] == maxlen]
            labels = [f"{c['agents']}\n{'testbed' if c['source'] == 'testbed' else 'sim'} {c['cluster'].split()[0]}"
                      for c in mine]
            vals = [c["speedup"] or 0.0 for c in mine]
            colors = [plots.color("dualpath") if c["source"] == "testbed" else "#999999" for c in mine]
            ax.bar(range(len(mine)), vals, color=colors)
            for k, c in enumerate(mine):
                ax.text(k, (c["speedup"] or 0.0) + 0.03, "does not fit" if c["speedup"] is None else f"{c['speedup']:.2f}x",
                        ha="center", fontsize=7)
            ax.axhline(1.0, color="black", lw=0.6)
            ax.set_xticks(range(len(mine)), labels, fontsize=7)
            ax.set_title(f"{model}, MaxLen {maxlen}", fontsize=8)
            if j == 0:
                ax.set_ylabel("DualPath speed-up over Basic (x)", fontsize=8)
    top = max((c["speedup"] for c in rows + sim if c["speedup"] is not None), default=1.0)
    axes[0][0].set_ylim(0, max(1.25, top * 1.15))  # shared: room for the labels above the bars
    fig.suptitle("Figure 7, every panel: DualPath's speed-up over Basic by model and MaxLen "
                 "(coloured: testbed, lengths / 32; grey: simulated, the paper's lengths and cluster)", fontsize=9)
    fig.tight_layout()
    plots.save(fig, out / "fig7_panels.png")
    return ["fig7_panels.png"]


def grid_section(sim: list[dict], val: dict | None, quick: bool) -> str:
    v = ("no committed `dualpath sim --validate`" if val is None else
         f"the simulator's committed validation ({val['report']}): mean JCT error {val['mean_jct_err']:.2%}, max "
         f"{val['max_jct_err']:.2%} over {val['runs']} FAITHFUL testbed runs at the testbed's scale; no testbed run "
         "exists at these lengths and sizes to check them against")
    rows = []
    for c in sim:
        j = c["jct_s"]
        cells = (" | ".join(f"{j[m]:.4g}" for m in MODES) + f" | {c['speedup']:.3g} | {c['dualpath_over_oracle']:.3g}"
                 if c["speedup"] is not None else f"— | — | — | does not fit ({c['failed']} of {c['requests']} requests "
                 f"failed) | —")
        rows.append(f"| {c['model']} | {c['cluster']} | {c['maxlen']} | {c['agents']} | {cells} |")
    failed = next((c for c in sim if c["failed"]), None)
    why = (f" A cell that does not fit: {failed['failure']} (the paper serves Qwen2.5-32B with data parallelism "
           "only, a full BF16 copy per GPU, which leaves an H800 6.47 GB for KV: contexts past 24,689 tokens "
           "cannot decode; the paper does not say how its 48K and 64K Qwen contexts fit).") if failed else ""
    return "\n".join([
        "## Every panel: the paper's models on the paper's clusters, simulated", "",
        f"Not testbed results (`source: simulated` in summary.json's `cells`, `faithful: null`): "
        f"testbed.reproduce.paper_rows, in the target's own units at the paper's lengths, {v}. Agents: "
        f"{' and '.join(map(str, paper_rows.AGENTS_PER_PE_NODE[quick]))} per prefill node (the module says why not "
        f"the paper's 512-4096).{why}",
        "", "| model | cluster | MaxLen | agents | Basic JCT (s) | DualPath JCT | Oracle JCT | speed-up (x) | "
        "DualPath / Oracle |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |", *rows])
