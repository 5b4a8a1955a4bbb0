"""Run a reproduction's plan on the testbed: each config is one `dualpath run`.

`run_config` is the one function that runs a config. It does what `dualpath run` does
(testbed.cli.run._run_e2e): bring the topology up, `run_e2e` in every mode, `summarize`,
`write_results`, report.md; it builds the workload from the config's WorkloadSpec (the paper's
presets, scaled, with the append/generation/turn knobs) instead of the demo's, and writes
plan.json beside the results (which config, its digest) so the folder can be found and reused.
It needs root and the testbed; nothing in the analyses calls it.

`execute` runs every config of a plan into <runs_root>/<config folder>/, reusing a folder there
that already holds a FAITHFUL run of the same digest (so fig13 and fig14, and the online figures,
share runs). Online configs give each agent its arrival time (Trajectory.arrival_s, testbed
seconds since the mode's start), which the conductor honours. A config whose run fails (an
error, not an UNFAITHFUL verdict) is reported missing with the error, and the rest still runs.
"""
from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Callable

from testbed.reproduce import online as online_mod
from testbed.reproduce.plan import Plan, RunConfig
from testbed.measure.runs import Run, _is_run, load_run, write_plan


def build_workload(cfg: RunConfig, dilation: float):
    """The config's workload; online configs get Poisson arrival times (testbed seconds)."""
    from dualpath.workload import generate, poisson_arrivals, with_arrivals

    if cfg.trace is not None:  # the trace's own arrivals (emulated s) on the testbed's clock
        from dualpath.workload.trace import load_trace
        from testbed.reproduce.plan import RUN_BLOCK_TOKENS, in_repo

        return load_trace(in_repo(cfg.trace), RUN_BLOCK_TOKENS).workload(RUN_BLOCK_TOKENS, dilation)
    wl = generate(cfg.workload.config())
    if cfg.online:
        arr = poisson_arrivals(len(wl.trajectories), cfg.online.aps, seed=cfg.online.seed)
        wl = replace(wl, trajectories=tuple(with_arrivals(wl.trajectories, [a * dilation for a in arr])))
    return wl


def run_config(cfg: RunConfig, run_dir: Path, command: str, progress: Callable[[str], None] = print,
               checkpoint: Path | None = None) -> Run:
    """One config as one `dualpath run` into run_dir (needs root and the testbed)."""
    from dualpath.model.registry import prepare_tiny as demo_checkpoint
    from testbed.experiments.ablation import run_geometry, run_to_folder

    topo = cfg.topology_obj()
    ckpt = checkpoint or demo_checkpoint()
    k = topo.dilation(run_geometry(ckpt).kv_bytes_per_token)
    wl = build_workload(cfg, k)
    progress(f"  run {cfg.describe()}")
    extra = {"workload_spec": cfg.to_dict()["workload"]} if cfg.trace is None else {}
    if cfg.online:
        extra["arrivals"] = {"aps": cfg.online.aps, "seed": cfg.online.seed, "agents": len(wl.trajectories),
                             "unit": "agents per emulated second"}
    run_to_folder(topo, wl, ckpt, run_dir, command, cfg.modes, progress, quota_s=cfg.quota_ms / 1000, extra=extra)
    write_plan(run_dir, {"key": cfg.key, "digest": cfg.digest(), "config": cfg.to_dict()})
    return load_run(run_dir)


def execute(plan: Plan, runs_root: Path, command: str = "", progress: Callable[[str], None] = print,
            fresh: bool = False, runner: Callable[..., Run] = run_config) -> tuple[dict[str, Run], dict[str, str]]:
    """Every config of the plan (then the online search's probes): ({key: Run}, {key: why missing})."""
    runs: dict[str, Run] = {}
    missing: dict[str, str] = {}
    done: dict[str, Run] = {}  # digest -> this execution's run of it (shared even when fresh)
    for cfg in plan.configs:
        try:
            runs[cfg.key] = _one(cfg, runs_root, command, progress, fresh, runner, done)
        except RuntimeError as e:  # the run failed (and tore down): the figure is incomplete, say why
            missing[cfg.key] = f"the run failed: {e}"
    if plan.search and not any(k in missing for k in (c.key for c in plan.configs if c.online)):
        _search(plan, runs, runs_root, command, progress, fresh, runner, done)
    return runs, missing


def _one(cfg: RunConfig, runs_root: Path, command: str, progress, fresh: bool, runner, done: dict) -> Run:
    if cfg.digest() in done:
        return done[cfg.digest()]
    d = Path(runs_root) / cfg.folder()
    if not fresh and _is_run(d):
        r = load_run(d)
        if r.plan and r.plan.get("digest") == cfg.digest() and r.faithful(cfg.modes):
            progress(f"  reusing {d} (FAITHFUL, same config)")
            done[cfg.digest()] = r
            return r
    if d.exists():
        shutil.rmtree(d)
    done[cfg.digest()] = runner(cfg, d, command, progress)
    return done[cfg.digest()]


def probe_agents(plan: Plan, aps: float) -> int:
    """The agents a search probe at `aps` runs: the grid's last config's agents per APS (the
    longest arrival span's), never fewer than it has."""
    template = [c for c in plan.configs if c.online][-1]
    return max(template.workload.agents, round(aps * template.workload.agents / template.online.aps))


def _search(plan: Plan, runs: dict[str, Run], runs_root: Path, command: str, progress, fresh: bool, runner,
            done: dict) -> None:
    """Bisect each mode's highest APS under the SLO between the grid's best pass and first fail."""
    grid = [c for c in plan.configs if c.online]
    if not grid:
        return
    for mode in plan.search.modes:
        pts = [(c.online.aps, online_mod.point(runs[c.key], mode)["meets_slo"]) for c in grid
               if c.key in runs and runs[c.key].has(mode)]
        template = grid[-1]

        def evaluate(aps: float) -> bool:
            agents = probe_agents(plan, aps)
            cfg = replace(template, key=f"online/{mode}/aps={aps:.3g}", modes=(mode,),
                          workload=replace(template.workload, agents=agents),
                          online=replace(template.online, aps=round(aps, 3)), params={"aps": round(aps, 3)})
            runs[cfg.key] = _one(cfg, runs_root, command, progress, fresh, runner, done)
            return online_mod.point(runs[cfg.key], mode)["meets_slo"]

        online_mod.search(evaluate, pts, plan.search.rel_tol, plan.search.max_probes)
