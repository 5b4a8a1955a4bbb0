"""`sim`: the simulator run, calibrated and validated from the command line."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer

from simulator.calibration import COMMITTED
from testbed.topology import TopologyError, load_topology
from testbed.cli.shared import AGENTS_OPT, APPEND_SCALE_OPT, GEN_SCALE_OPT, LADDER, LENGTH_SCALE_OPT, OFFLINE_OPT, TIME_SCALE_OPT, TRACE_LIMIT_OPT, TRACE_OPT, TRACE_WINDOW_OPT, WORKLOAD_OPT, _fail, _trace_lines, _workload_options, app


SIM_CALIBRATION = COMMITTED


@app.command("sim")
def sim_cmd(topology: Optional[Path] = typer.Argument(None, help="topology YAML (testbed's, or topologies/sim/ "
                                                      "with --units target)"),
            modes: str = typer.Option(LADDER, help="comma-separated modes"),
            trajectories: Optional[int] = typer.Option(None, min=1, max=1_000_000, help="agentic trajectories "
                                                       "(default 24; the same as --agents)"),
            seed: int = typer.Option(0, help="workload seed"),
            first_turn_tokens: int = typer.Option(0, min=0, max=1_000_000, help="each trajectory's first turn "
                                                  "appends this many tokens (0: the workload's own)"),
            aps: float = typer.Option(0.0, min=0.0, max=1e6, help="online: agents arrive as a Poisson process "
                                      "at this many per emulated second (0: all at once)"),
            quota_ms: int = typer.Option(300, min=1, max=60_000, help="PE compute quota per forward pass, emulated ms"),
            units: str = typer.Option("testbed", help="testbed: the testbed's KV and scaled rates (what validation "
                                      "compares); target: the target model's KV at the paper's rates, dilation 1"),
            calibration: Optional[Path] = typer.Option(None, help=f"calibration file (default {SIM_CALIBRATION} "
                                                       "when it exists; none with --units target)"),
            calibrate: Optional[list[Path]] = typer.Option(None, "--calibrate", help="fit the calibration on this "
                                                           "FAITHFUL testbed run folder and write it to --calibration; "
                                                           "repeatable, runs of one topology (offline and online)"),
            validate: bool = typer.Option(False, "--validate", help="compare the simulator with testbed runs "
                                          "(--runs) per configuration and mode"),
            runs: Optional[list[Path]] = typer.Option(None, "--runs", help="with --validate: testbed run folders; "
                                                      "repeatable"),
            burst: Optional[Path] = typer.Option(None, help="with --calibrate: a `dualpath bench burst` folder of "
                                                 "the same topology (how far past its HTB bucket a fresh flow goes)"),
            replicas: int = typer.Option(8, min=1, max=100, help="with --validate: simulations per configuration "
                                         "(seeds 0, 1, ...) whose mean is compared, when the calibration has jitter"),
            quick: bool = typer.Option(False, "--quick", help="with --calibrate: fewer fit iterations"),
            out: Path = typer.Option(Path("results/sim"), help="where the run's folder goes"),
            workload: Optional[str] = WORKLOAD_OPT, trace: Optional[str] = TRACE_OPT,
            length_scale: Optional[float] = LENGTH_SCALE_OPT, append_scale: Optional[float] = APPEND_SCALE_OPT,
            gen_scale: Optional[float] = GEN_SCALE_OPT, agents: Optional[int] = AGENTS_OPT,
            trace_limit: Optional[int] = TRACE_LIMIT_OPT, trace_window: Optional[str] = TRACE_WINDOW_OPT,
            offline: bool = OFFLINE_OPT, time_scale: Optional[float] = TIME_SCALE_OPT) -> None:
    """Simulate a cluster (simulator): the testbed's scheduler and cost model at any scale."""
    wopts = _workload_options(workload, trace, length_scale, append_scale, gen_scale, agents, trace_limit,
                              trace_window, offline, time_scale, seed, first_turn_tokens, aps, trajectories)
    from simulator.calibration import UNCALIBRATED, Calibration

    command = " ".join(["dualpath", *sys.argv[1:]])
    if sum(bool(x) for x in (calibrate, validate)) > 1:
        _fail("sim: --calibrate and --validate are separate steps; fix: run one, then the other")
    if burst and not calibrate:
        _fail("sim: --burst goes with --calibrate (the measured burst becomes part of the calibration)")
    if calibrate:
        _sim_calibrate(calibrate, calibration or SIM_CALIBRATION, quick, burst, command)
        return
    if validate and not runs:
        _fail("sim --validate: name the testbed runs to compare with (--runs FOLDER, repeatable)")
    cal_path = calibration or (SIM_CALIBRATION if SIM_CALIBRATION.exists() and units == "testbed" else None)
    try:
        cal = Calibration.load(cal_path) if cal_path else UNCALIBRATED
    except ValueError as e:
        _fail(f"sim --calibration: {e}")
    if validate:
        if cal_path is None:
            _fail(f"sim --validate: no calibration ({SIM_CALIBRATION} is missing); fix: dualpath sim --calibrate RUN")
        _sim_validate(runs, cal, out, replicas, command)
    if topology is None:
        _fail("sim: name a topology (e.g. topologies/1p1d-io.yaml, or topologies/sim/48p96d.yaml --units target)")
    wcfg, tw = _sim_workload(wopts, trace is not None and length_scale is None and units == "target",
                             seed, trajectories or 24, first_turn_tokens)
    _sim_run(topology, modes, units, wcfg, tw, cal, out, quota_ms, aps, seed, command)


def _sim_calibrate(calibrate: list[Path], dest: Path, quick: bool, burst: Optional[Path], command: str) -> None:
    """Fit the simulator's calibration on testbed runs and save it to `dest`."""
    from simulator.calibration import Calibration
    from testbed.measure.runs import RunError, load_run
    from testbed.sim.fit import calibrate as fit

    try:
        fit_runs = [load_run(p) for p in calibrate]
    except RunError as e:
        _fail(f"sim --calibrate: {e}")
    for p, run in zip(calibrate, fit_runs):
        typer.echo(f"calibrating on {p} ({run.topology}{f' at {run.aps:g} APS' if run.aps else ''}, "
                   f"modes {', '.join(run.modes)})")
    try:
        cal = fit(fit_runs, typer.echo, iterations=3 if quick else 8, burst=burst)
    except ValueError as e:
        _fail(f"sim --calibrate: {e}")
    cal = Calibration(**{**cal.to_dict(), "source": {**cal.source, "command": command,
                                                       "run_command": cal.source.get("command")}})
    cal.save(dest)
    typer.echo(f"calibration: {dest} (rms relative error {cal.source['rms_relative_error']})")


def _sim_validate(runs: list[Path], cal, out: Path, replicas: int, command: str) -> None:
    """Compare the simulator with testbed runs; exits 0 when the targets are met, else 1."""
    from testbed.measure.runs import RunError, load_run
    from testbed.sim.validation_report import validate_to_folder

    try:
        loaded = [load_run(r) for r in runs]
    except RunError as e:
        _fail(f"sim --validate: {e}")
    folder, agg = validate_to_folder(loaded, cal, out / "validate" / time.strftime("%Y%m%d-%H%M%S"), command,
                                     typer.echo, replicas)
    typer.echo(f"mean |JCT error| {agg['mean_jct_err']}, max {agg['max_jct_err']}, held out mean "
               f"{agg['held_out_mean_jct_err']}; targets {'met' if agg['meets_targets'] else 'NOT met'}")
    typer.echo(f"results: {folder}/summary.json, report.md, scatter.png")
    raise typer.Exit(0 if agg["meets_targets"] else 1)


def _sim_run(topology: Path, modes: str, units: str, wcfg, tw, cal, out: Path, quota_ms: int, aps: float,
             seed: int, command: str) -> None:
    """Simulate a topology in every mode and write a run folder like `dualpath run`'s."""
    from testbed.cluster.modes import MODES
    from testbed.sim.drive import run_sim_to_folder

    try:
        t = load_topology(topology, carried=units == "testbed")
    except TopologyError as e:
        _fail(str(e))
    mode_list = tuple(m.strip() for m in modes.split(",") if m.strip())
    bad = [m for m in mode_list if m not in MODES]
    if bad or not mode_list:
        _fail(f"--modes: unknown mode(s) {','.join(bad)[:80] or repr(modes[:80])}; fix: choose from {','.join(MODES)}")
    if units not in ("testbed", "target"):
        _fail(f"--units: {units[:40]!r} is not testbed or target")
    run_dir = out / time.strftime("%Y%m%d-%H%M%S")
    try:
        summary = run_sim_to_folder(t, wcfg, mode_list, run_dir, command, units=units, cal=cal,
                                    quota_s=quota_ms / 1000, aps=aps or None, seed=seed, progress=typer.echo, trace=tw)
    except ValueError as e:
        _fail(" ".join(str(e).split()))
    for m, v in summary["modes"].items():
        typer.echo(f"  {m}: JCT {v['jct_s']:.4g} s, TTFT p50 {v['ttft_s']['p50']}, TPOT p50 {v['tpot_s']['p50']}, "
                   f"SNIC max/avg {v['snic_max_over_avg']}")
    typer.echo(f"results: {run_dir}/summary.json, records.jsonl, report.md")


def _sim_workload(wopts, own_scale: bool, seed: int, trajectories: int, first_turn_tokens: int):
    """`dualpath sim`'s workload: (WorkloadConfig, None) generated, or (its config, TraceWorkload)
    replayed; a trace in target units defaults to its own lengths (scale 1). One line and exit 2
    for a bad trace or a workload that cannot be generated."""
    from dataclasses import replace

    from dualpath.workload import TraceError, demo_workload
    from dualpath.workload.spec import describe_scale
    from dualpath.workload.trace import TraceSpec, load_trace
    from testbed.sim.drive import RUN_BLOCK_TOKENS

    try:
        if wopts is None:
            return demo_workload(seed=seed, n_trajectories=trajectories, first_append_len=first_turn_tokens), None
        if not isinstance(wopts, TraceSpec):
            typer.echo(describe_scale(wopts, RUN_BLOCK_TOKENS))
            return wopts.config(), None
        spec = replace(wopts, length_scale=1) if own_scale else wopts
        tw = load_trace(spec, RUN_BLOCK_TOKENS)
    except (TraceError, ValueError) as e:
        _fail(" ".join(str(e).split()))
    typer.echo(describe_scale(spec, RUN_BLOCK_TOKENS))
    for line in _trace_lines(tw.stats()):
        typer.echo(line)
    return tw.config(), tw
