"""The validation's report: its lines, the scatter plot, and the folder it writes."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

from simulator.calibration import Calibration
from testbed.measure.runs import Run
from testbed.paths import REPO
from testbed.sim.fit import LATENCIES
from testbed.sim.validate import REPLICAS, SPREAD_STEP, TARGETS, _noise, _pct, _per_path_medians, aggregate, group_repeats, noise, validate_config


def scatter(rows: list[dict[str, Any]], path: Path) -> Path:
    """Simulated against measured: JCT and TTFT p50 per configuration and mode."""
    from testbed.measure import plots

    fig, axes = plots.plt.subplots(1, 2, figsize=(10.5, 4.6), dpi=plots.DPI)
    for ax, key, what in ((axes[0], "jct_s", "JCT"), (axes[1], "ttft_p50_s", "TTFT p50")):
        xs, ys = [], []
        for r in rows:
            a, b = r[key]["testbed"], r[key]["sim"]
            if a is None or b is None:
                continue
            xs.append(a)
            ys.append(b)
            runs = r[key].get("testbed_runs") or []
            if r[key].get("sim_sd") or len(runs) > 1:  # the simulations' sd; the testbed runs' range
                ax.errorbar([a], [b], yerr=r[key].get("sim_sd"),
                            xerr=[[a - min(runs)], [max(runs) - a]] if len(runs) > 1 else None,
                            color=plots.color(r["mode"]), lw=0.8, capsize=2, zorder=1)
            ax.scatter([a], [b], color=plots.color(r["mode"]), marker="o" if r["held_out"] else "s",
                       s=34, edgecolors="black" if not r["held_out"] else "none", linewidths=0.6, zorder=2)
        lo, hi = min(xs + ys) * 0.9, max(xs + ys) * 1.1
        ax.plot([lo, hi], [lo, hi], color="#444444", lw=0.8)
        ax.fill_between([lo, hi], [lo * 0.95, hi * 0.95], [lo * 1.05, hi * 1.05], color="#bbbbbb", alpha=0.3, lw=0,
                        label="within 5 %")
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # plain seconds at 1, 2, 5 x 10^k, not powers of ten
            axis.set_major_locator(plots.mticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(plots.mticker.FormatStrFormatter("%g"))
            axis.set_minor_formatter(plots.mticker.NullFormatter())
        ax.set_xlabel(f"testbed {what} (emulated s)")
        ax.set_ylabel(f"simulated {what} (emulated s)")
        ax.set_title(f"{what}: simulated against measured")
        ax.grid(True, alpha=0.3)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], marker="o", ls="", color=plots.color(m), label=plots.label(m))
               for m in dict.fromkeys(r["mode"] for r in rows)]
    handles.append(Line2D([], [], marker="s", ls="", color="white", markeredgecolor="black", label="calibration config"))
    axes[1].legend(handles=handles, loc="upper left", fontsize=7)
    plots.caption(fig, "Each point is one mode of one testbed configuration; squares are the configuration the "
                       "simulator was calibrated on, circles are held out. The band is +-5 %. Bars: the simulations' "
                       "standard deviation (vertical) and the range of a configuration's testbed runs (horizontal).")
    return plots.save(fig, path)


def code_lines(codes: dict[str, dict[str, Any] | None],
               calibration_codes: dict[str, dict[str, Any] | None] | None = None) -> list[str]:
    """What the report says about the code each testbed run was made on (summary.json's `code`),
    and, given the calibration's runs' codes, whether the calibration was fitted on the same code."""
    known = {p: c for p, c in codes.items() if c}
    commits = {c["commit"] for c in known.values()}
    if not known:
        lines = ["Code: no run records the commit it was made on (made before runs recorded it)."]
    else:
        dirty = any(c.get("dirty") for c in known.values())
        lines = ["Code: " + "; ".join(f"`{p}` {c['commit'][:12]}{' (dirty)' if c.get('dirty') else ''}"
                                      for p, c in known.items())
                 + (f"; {len(codes) - len(known)} run(s) record none" if len(known) < len(codes) else "") + "."]
        if len(commits) > 1 or dirty:
            lines.append(f"WARNING: the runs come from {len(commits)} commit(s){' and uncommitted changes' if dirty else ''}: "
                         "a run made on other code measures another testbed (`git diff` between them, under dualpath/ "
                         "and emulators/, shows what changed); re-make the older runs before trusting the errors.")
    if calibration_codes is None:
        return lines
    # The calibration's latencies are the testbed software's own costs: fitted on runs of older
    # code, they describe a testbed that is gone (2026-12: runs of 226 commits later spent 14 %
    # less time beyond a pass's windows, and every lightly loaded prediction came out long).
    fitted = {c["commit"] for c in calibration_codes.values() if c}
    if not fitted:
        lines.append("WARNING: the calibration's runs record no commit (made before runs recorded it, or their "
                     "folders are gone), so nothing says it models the code these runs were made on; re-fit it on "
                     "runs of that code (`dualpath sim --calibrate`).")
    elif fitted != commits:
        lines.append(f"WARNING: the calibration was fitted on runs of {', '.join(sorted(c[:12] for c in fitted))}, "
                     "not (only) the code of these runs: its latencies are another testbed's if the code changed "
                     "in between; re-fit it on runs of this code (`dualpath sim --calibrate`).")
    else:
        lines.append("Calibration: fitted on runs of the same code.")
    return lines


def calibration_codes(cal: Calibration) -> dict[str, dict[str, Any] | None]:
    """The code each of the calibration's runs was made on, from its folder's summary.json (a path
    relative to the repository); None where the folder is gone or its run records none."""
    out: dict[str, dict[str, Any] | None] = {}
    for s in cal.source.get("runs", []):
        if not s.get("run"):
            continue
        path = Path(s["run"])
        path = path if path.is_absolute() else REPO / path
        try:
            out[s["run"]] = json.loads((path / "summary.json").read_text()).get("code")
        except (OSError, ValueError):
            out[s["run"]] = None
    return out


def ensemble_line(cal: Calibration, rows: list[dict[str, Any]]) -> str:
    """What a row's two sides are: a mean over the testbed's repeats, a mean over seeded simulations."""
    n = max((r.get("replicas") or 1 for r in rows), default=1)
    sim = (f"Each simulated value is the mean of {n} simulations (seeds 0-{n - 1}; sd beside it): the calibration's "
           f"latencies vary by {cal.jitter:.2f} (relative sd) from one message to the next, as the testbed's do, so "
           "one simulation is one draw of the order of events." if cal.jitter and n > 1 else
           "Each simulated value is one simulation (every latency exactly its value).")
    noise = (" In brackets after an error, its noise: one standard error of the difference from the order of "
             "events alone (the simulations' spread, the model's estimate of one run's, over these simulations and the "
             "row's testbed runs); an error within about twice its noise cannot be told from run-to-run variation with "
             "this many runs, and still counts against the targets." if cal.jitter and n > 1 else "")
    return (sim + " A configuration run more than once on the testbed (same topology, workload, seeds) is compared "
            "with the mean of its runs (each in brackets)." + noise)


def report_lines(command: str, cal: Calibration, rows: list[dict[str, Any]], agg: dict[str, Any],
                 codes: dict[str, dict[str, Any] | None] | None = None,
                 cal_codes: dict[str, dict[str, Any] | None] | None = None) -> list[str]:
    src = cal.source
    fitted = " and ".join(f"`{s.get('run')}` (summary sha256 {s.get('summary_sha256')})" for s in src.get("runs", [src]))
    lines = [f"# dualpath sim --validate", "", f"Produced by `{command}`.", "",
             f"Calibration: fitted on {fitted} ({src.get('topology')}, dilation {src.get('dilation')}) by "
             f"`{src.get('fitted_by')}`; "
             f"{src.get('simulations')} simulations, rms relative error {src.get('rms_relative_error')}.", "",
             ensemble_line(cal, rows), "",
             "| config | mode | held out | runs | JCT testbed | JCT sim | JCT err (noise) | TTFT p50 err (noise) | TTFT p99 err | TPOT p50 err | SNIC max/avg (tb / sim) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        sb = r["snic_max_over_avg"]
        tb_runs = r["jct_s"].get("testbed_runs") or []
        sd = r["jct_s"].get("sim_sd")
        lines.append(f"| {r['config']} | {r['mode']} | {'yes' if r['held_out'] else 'no'} | {len(tb_runs) or 1} | "
                     f"{r['jct_s']['testbed']:.4g}{' (' + ' / '.join(f'{x:.4g}' for x in tb_runs) + ')' if len(tb_runs) > 1 else ''} | "
                     f"{r['jct_s']['sim']:.4g}{f' (sd {sd:.2g})' if sd is not None else ''} | {_pct(r['jct_err'])}{_noise(r.get('jct_noise'))} | "
                     f"{_pct(r['ttft_p50_err'])}{_noise(r.get('ttft_p50_noise'))} | {_pct(r['ttft_p99_err'])} | "
                     f"{_pct(r['tpot_p50_err'])} | {sb['testbed']} / {sb['sim']}{'' if r['snic_balance_diff'] is not None else ' (n/a: no KV on SNICs)'} |")
    lines += ["", f"Mean |JCT error| {_pct(agg['mean_jct_err'])}, max {_pct(agg['max_jct_err'])}; held out: mean "
                  f"{_pct(agg['held_out_mean_jct_err'])}, max {_pct(agg['held_out_max_jct_err'])}. TTFT p50 max "
                  f"{_pct(agg['max_ttft_p50_err'])} (held out {_pct(agg['held_out_max_ttft_p50_err'])}); SNIC max/avg "
                  f"max difference {agg['max_snic_balance_diff']}. Every testbed run FAITHFUL: {agg['all_faithful']}.",
              f"Targets (issue 15): mean JCT <= 2 %, max <= 5 %, TTFT p50 <= 5 %, SNIC max/avg within 0.05: "
              f"{'met' if agg['meets_targets'] else 'NOT met'}.", ""]
    if codes is not None:
        lines += code_lines(codes, cal_codes) + [""]
    wide = [r for r in rows if (r.get("jct_spread") or 0) > TARGETS["max_jct_err"]
            or (r.get("ttft_p50_spread") or 0) > TARGETS["ttft_p50_err"]]
    lines += [f"Sensitivity: each fitted latency moved by {SPREAD_STEP:.0%}, one at a time (one simulation each, "
              f"seed 0{', jitter on' if cal.jitter else ''}), moves a row's "
              f"prediction at most {_pct(agg.get('max_jct_spread')).strip()} (JCT) and "
              f"{_pct(agg.get('max_ttft_p50_spread')).strip()} (TTFT p50), max - min over the "
              f"{2 * len([f for f in LATENCIES if getattr(cal, f)]) + 1} simulations, relative to the testbed."]
    lines += [f"- {r['config']} {r['mode']}: JCT band {_pct(r['jct_spread']).strip()}, TTFT p50 band "
              f"{_pct(r['ttft_p50_spread']).strip()}: wider than the target, so the order of events (which request "
              "goes where, first), not the model's rates, decides where in it the prediction falls; its error is "
              "counted above." for r in wide]
    lines += [""]
    for r in rows:
        if r.get("ttft_p50_between_modes"):
            q = r["ttft_p45_p55_s"]
            lines += [f"{r['config']} {r['mode']}: its testbed TTFT median lies between two modes (p45 "
                      f"{q['testbed'][0]:.3g} s, p55 {q['testbed'][1]:.3g} s, testbed seconds; simulated "
                      f"{q['sim'][0]:.3g} s and {q['sim'][1]:.3g} s): one request more or less on either side moves "
                      "the median across the gap, so its p50 error is counted above but says little; compare the "
                      "quantiles around it" + _per_path_medians(r.get("ttft_p50_per_path_s")) + ".", ""]
    lines += ["Calibration constants (real seconds of the testbed's software):", "", "```",
              json.dumps(cal.constants(), indent=1), "```"]
    return lines


def validate_to_folder(runs: Sequence[Run], cal: Calibration, folder: Path, command: str,
                       progress: Callable[[str], None] = print, replicas: int = REPLICAS) -> tuple[Path, dict[str, Any]]:
    """`dualpath sim --validate`: every run's rows, the aggregate, summary.json, report.md and the
    scatter plot in `folder`."""
    rows: list[dict[str, Any]] = []
    for group in group_repeats(runs):
        rows += validate_config(group, cal, progress, replicas)
    agg = aggregate(rows)
    folder.mkdir(parents=True, exist_ok=True)
    codes = {str(r.path): r.summary.get("code") for r in runs}
    cal_codes = calibration_codes(cal)
    summary = {"command": command, "faithful": agg["all_faithful"], "validation": rows, **agg,
               "replicas": replicas if cal.jitter else 1,
               "calibration": cal.to_dict(), "runs": [str(r.path) for r in runs], "run_code": codes,
               "calibration_run_code": cal_codes}
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    scatter(rows, folder / "scatter.png")
    (folder / "report.md").write_text("\n".join(report_lines(command, cal, rows, agg, codes, cal_codes)) + "\n")
    return folder, agg
