"""Table 2: the generated workload's statistics for the paper's three trace sets, scaled.

Each preset (dualpath.workload.paper_presets) is generated with every length divided by the
scale factor (PAPER_SCALE = 32: the 64K set's MaxLen becomes 2,048 tokens, the demo's) and the
paper's 500 trajectories (100 with --quick); lengths are reported multiplied back by the factor,
in the paper's units. The hit rate is counted with the paper's 64-token Full Blocks scaled the
same way (64 / 32 = 2 tokens), and with the runs' 32-token blocks beside it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from dualpath.workload import generate, paper_presets, scaled, workload_stats
from dualpath.workload.trajectories import sample_turns
from testbed.measure import plots
from testbed.reproduce.common import Headline, Result, fmt
from testbed.reproduce.plan import PAPER_SCALE, RUN_BLOCK_TOKENS, Plan

ID = "table2"
TITLE = "Agent trace statistics: the generated workload against the paper's three traces"
PAPER_BLOCK = 64  # tokens per Full Block in the paper (section 4.1)
# What must match, and how closely (statistic -> relative tolerance; hit rate: absolute).
TOLERANCE = {"append_mean": 0.05, "gen_mean": 0.05, "context_mean": 0.10, "total_len_mean": 0.10, "hit_rate": 0.01,
             "turns_drawn": 0.05}
STATS = (("turns_drawn", "turns per trajectory, drawn (before MaxLen)"),
         ("turns_mean", "turns per trajectory, kept (after MaxLen)"),
         ("append_mean", "append tokens per turn"), ("gen_mean", "generated tokens per turn"),
         ("context_mean", "context tokens per turn"), ("total_len_mean", "tokens per trajectory at the end"),
         ("hit_rate", "KV hit rate"))


N_TRAJECTORIES = 500  # the paper's; --quick too (it takes seconds, and fewer would not match: turns spread widely)


def plan(quick: bool = False) -> Plan:
    return Plan(ID, quick, [], scale_down=f"lengths divided by {PAPER_SCALE} (64K MaxLen -> {65536 // PAPER_SCALE} "
                                         f"tokens), {N_TRAJECTORIES} trajectories per set as in the paper; no testbed run")


def preset_stats(name: str, factor: float = PAPER_SCALE, n: int = 500, seed: int = 0) -> dict:
    """The statistics of one preset's generated workload, lengths in the paper's units."""
    cfg = scaled(name, factor, n_trajectories=n, seed=seed)
    wl = generate(cfg)
    block = max(1, round(PAPER_BLOCK / factor))
    s = workload_stats(wl.trajectories, block_size=block)
    s_run = workload_stats(wl.trajectories, block_size=RUN_BLOCK_TOKENS)
    # the turn counts the generator drew before truncation (each trajectory's stream starts with them)
    drawn = [sample_turns(np.random.default_rng([seed, 1 + i]), cfg.turns_mean, cfg.turns_cv, cfg.turns_min)
             for i in range(n)]
    p = paper_presets()[name]
    return {
        "preset": name, "scale_factor": factor, "trajectories": s["trajectories"], "max_len": p.max_len,
        "turns_drawn": float(np.mean(drawn)) if drawn else 0.0, "turns_mean": s["turns_mean"],
        "append_mean": s["append_mean"] * factor, "gen_mean": s["gen_mean"] * factor,
        "context_mean": s["prompt_len_mean"] * factor, "total_len_mean": s["total_len_mean"] * factor,
        "hit_rate": s["hit_rate"], "hit_block_tokens": block, "hit_rate_run_blocks": s_run["hit_rate"],
        "run_block_tokens": RUN_BLOCK_TOKENS, "system_prompt_tokens": len(wl.system_prompt) * factor,
        "notes": list(cfg.notes),
        "paper": {"trajectories": p.n_trajectories, "turns_drawn": p.turns_mean, "turns_mean": p.turns_mean,
                  "append_mean": p.append_mean, "gen_mean": p.gen_mean, "context_mean": p.context_mean,
                  "total_len_mean": p.total_len_mean, "hit_rate": p.hit_rate},
    }


def check(st: dict) -> list[dict]:
    """Each statistic the paper gives, against its tolerance (turns kept: reported, not checked)."""
    out = []
    for key, tol in TOLERANCE.items():
        pv = st["paper"].get(key)
        if pv is None:
            continue
        tv = st[key]
        dev = tv - pv if key == "hit_rate" else tv / pv - 1
        out.append({"preset": st["preset"], "stat": key, "testbed": round(tv, 4), "paper": pv, "deviation": round(dev, 4),
                    "tolerance": tol, "within_tolerance": abs(dev) <= tol})
    return out


def analyze(quick: bool = False) -> dict:
    sets = [preset_stats(name, PAPER_SCALE, N_TRAJECTORIES) for name in ("32K", "48K", "64K")]
    return {"presets": sets, "checks": [c for s in sets for c in check(s)]}


def render(a: dict, out: Path) -> list[str]:
    fig, ax = plots.new_figure(f"Table 2: generated traces vs the paper (lengths scaled 1/{PAPER_SCALE}, shown x{PAPER_SCALE})",
                               "statistic", "generated / paper (1 = the paper's value)", size=(7.6, 4.4))
    keys = [k for k, _ in STATS]
    colors = {"32K": "#4c72b0", "48K": "#dd8452", "64K": "#c44e52"}
    width = 0.25
    for i, st in enumerate(a["presets"]):
        xs, ys = [], []
        for j, k in enumerate(keys):
            pv = st["paper"].get(k)
            if pv:
                xs.append(j + (i - 1) * width)
                ys.append(st[k] / pv)
        ax.bar(xs, ys, width * 0.95, color=colors[st["preset"]], label=f"MaxLen {st['preset']}")
        for x, y in zip(xs, ys):
            ax.annotate(f"{y:.2f}", (x, y), ha="center", va="bottom", fontsize=6, xytext=(0, 1), textcoords="offset points",
                    rotation=90)
    ax.axhspan(0.9, 1.1, color="#999999", alpha=0.15, label="paper's value ±10 %")
    ax.axhline(1.0, ls="--", lw=1, color=plots.PAPER_COLOR, label="paper's value")
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels(["turns\n(drawn)", "turns\n(kept)", "append\ntokens", "generated\ntokens", "context\ntokens",
                        "final\nlength", "hit rate"])
    ax.set_ylim(0, 1.5)
    plots.legend(ax, loc="upper center", ncol=3)
    plots.caption(fig, "Bars only where the paper gives the value. The paper's 157 turns of 429 + 176 tokens "
                       "exceed 64K, so MaxLen truncation keeps fewer turns than drawn.")
    plots.save(fig, out / "table2.png")
    return ["table2.png"]


def reproduce(runs: dict, out: Path, quick: bool = False) -> Result:
    a = analyze(quick)
    heads = []
    labels = dict(STATS)
    for st in a["presets"]:
        for key, lab in STATS:
            pv = st["paper"].get(key)
            if key in ("gen_mean", "context_mean", "total_len_mean", "hit_rate") and pv is None:
                continue  # the paper gives none for this set
            heads.append(Headline(f"{st['preset']}: {lab}" + ("" if key in ("hit_rate",) or key.startswith("turns")
                                                                 else " (paper units)"), st[key], pv, None))
        heads.append(Headline(f"{st['preset']}: KV hit rate with the runs' {RUN_BLOCK_TOKENS}-token blocks",
                              st["hit_rate_run_blocks"], None, None))
    notes = [f"Scale: every length divided by {PAPER_SCALE}; turn counts unscaled; lengths shown multiplied back. "
             f"Hit rate counted with the paper's {PAPER_BLOCK}-token blocks scaled the same way "
             f"({max(1, round(PAPER_BLOCK / PAPER_SCALE))} tokens).",
             "Tolerances: " + ", ".join(f"{labels[k]} {v * 100:g} point(s)" if k == "hit_rate" else f"{labels[k]} {v:.0%}"
                                        for k, v in TOLERANCE.items()) + ".",
             "Turns kept after MaxLen truncation are reported, not checked: the paper's means are not consistent "
             "with its MaxLen as plain means (64K: 157 turns x (429 + 176) tokens = 95K > 64K), so a generator "
             "with these means must truncate; the drawn counts match the paper."]
    for c in a["checks"]:
        if c["stat"] == "hit_rate":
            dev, tol = f"{c['deviation'] * 100:+.2f} points", f"{c['tolerance'] * 100:g} point(s)"
        else:
            dev, tol = f"{c['deviation']:+.1%}", f"{c['tolerance']:.0%}"
        notes.append(f"{c['preset']} {labels[c['stat']]}: {fmt(c['testbed'])} vs the paper's {fmt(c['paper'])} "
                     f"({dev}; {'within' if c['within_tolerance'] else 'OUTSIDE'} {tol})")
    for st in a["presets"]:
        notes += [f"{st['preset']}: {n}" for n in st["notes"]]
    pngs = render(a, out)
    return Result(ID, TITLE, heads, pngs, data={"presets": a["presets"], "checks": a["checks"],
                                               "scale_factor": PAPER_SCALE}, notes=notes,
                  scale_down=plan(quick).scale_down, no_runs_needed=True, sections=table_md(a["presets"]))


def table_md(sets: list[dict]) -> list[str]:
    """Table 2 in the paper's layout, generated (paper) per cell, lengths in the paper's units."""
    cols = (("trajectories", "trajectories", "{:.0f}"), ("turns_drawn", "turns (drawn)", "{:.1f}"),
            ("turns_mean", "turns (kept)", "{:.1f}"), ("append_mean", "append", "{:.0f}"),
            ("gen_mean", "generated", "{:.0f}"), ("context_mean", "context", "{:,.0f}"),
            ("total_len_mean", "final length", "{:,.0f}"), ("hit_rate", "hit rate", "{:.3f}"))
    out = [f"## Table 2 (generated at 1/{PAPER_SCALE} of the lengths, shown in paper tokens; the paper's value in brackets)",
           "", "| MaxLen | " + " | ".join(c[1] for c in cols) + " |", "| --- | " + " | ".join("---" for _ in cols) + " |"]
    for st in sets:
        cells = []
        for key, _, f in cols:
            pv = st["paper"].get(key)
            cells.append(f.format(st[key]) + (f" ({f.format(pv)})" if pv is not None else ""))
        out.append(f"| {st['preset']} | " + " | ".join(cells) + " |")
    return out
