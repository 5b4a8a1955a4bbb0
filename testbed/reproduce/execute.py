"""Run a reproduction's plan on the testbed: each config is one `dualpath run`.

`run_config` is the one function that runs a config. It does what `dualpath run` does
(testbed.cli._run_e2e): bring the topology up, `run_e2e` in every mode, `summarize`,
`write_results`, report.md; it builds the workload from the config's WorkloadSpec (the paper's
presets, scaled, with the append/generation/turn knobs) instead of the demo's, and writes
plan.json beside the results (which config, its digest) so the folder can be found and reused.
It needs root and the testbed; nothing in the analyses calls it.

`execute` runs every config of a plan into <runs_root>/<config folder>/, reusing a folder there
that already holds a FAITHFUL run of the same digest (so fig13 and fig14, and the online figures,
share runs). Online configs need the conductor's online runner, which does not exist yet: the
conductor starts every agent at once. `ONLINE_READY` says whether it exists (the runner must
honour Trajectory.arrival_s, in testbed seconds since the mode's start); until then an online
config is reported missing with that reason, and the offline parts of a figure still run.
"""
from __future__ import annotations

import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from testbed.reproduce import online as online_mod
from testbed.reproduce.plan import Plan, RunConfig
from testbed.reproduce.runs import Run, _is_run, load_run, write_plan


class NeedsOnlineRunner(RuntimeError):
    pass


def online_ready() -> bool:
    """Whether the conductor replays agents at their arrival times (the online runner). The
    runner, when it lands, sets testbed.conductor.ONLINE_ARRIVALS = True."""
    try:
        import testbed.conductor as conductor
    except ImportError:
        return False
    return bool(getattr(conductor, "ONLINE_ARRIVALS", False))


NEEDS_ONLINE = ("needs the online runner (Poisson arrivals in the conductor), which the testbed does not have "
                "yet: the conductor starts every agent at once")


def build_workload(cfg: RunConfig, dilation: float):
    """The config's workload; online configs get Poisson arrival times (testbed seconds)."""
    from dualpath.workload import generate, poisson_arrivals, with_arrivals

    wl = generate(cfg.workload.config())
    if cfg.online:
        arr = poisson_arrivals(len(wl.trajectories), cfg.online.aps, seed=cfg.online.seed)
        wl = replace(wl, trajectories=tuple(with_arrivals(wl.trajectories, [a * dilation for a in arr])))
    return wl


def run_config(cfg: RunConfig, run_dir: Path, command: str, progress: Callable[[str], None] = print,
               checkpoint: Path | None = None) -> Run:
    """One config as one `dualpath run` into run_dir (needs root and the testbed)."""
    if cfg.online and not online_ready():
        raise NeedsOnlineRunner(NEEDS_ONLINE)
    from testbed.cleanup import find_leftovers
    from testbed.cli import _demo_checkpoint
    from testbed.experiment import run_e2e, run_geometry, summarize, write_results
    from testbed.fabric import Fabric
    from testbed.report import e2e_lines

    topo = cfg.topology_obj()
    ckpt = checkpoint or _demo_checkpoint()
    geom = run_geometry(ckpt)
    k = topo.dilation(geom.bytes_per_token_per_layer * geom.n_layer)
    wl = build_workload(cfg, k)
    left = find_leftovers()
    if not left.empty():
        raise RuntimeError(f"leftovers of an earlier run exist ({left.summary()}); run `dualpath clean` first")
    run_id = time.strftime("%Y%m%d-%H%M%S")
    scratch = Path("/var/tmp") / f"dpt-run-{run_id}"
    progress(f"  run {cfg.describe()}")
    for line in topo.describe(geom.bytes_per_token_per_layer * geom.n_layer):
        progress(f"    {line}")
    t0 = time.monotonic()
    spec = topo.spec
    with Fabric(topo) as fab:
        results = run_e2e(fab, wl, ckpt, scratch, modes=cfg.modes, progress=progress, quota_s=cfg.quota_ms / 1000,
                          buffer_bytes=int(spec.dram_buffer_gib * 2**30), hbm_bytes=int(spec.hbm_gib_per_engine * 2**30))
    shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(results, wl, geom, topo)
    summary.update({"topology": topo.name, "trajectories": len(wl.trajectories), "seed": cfg.workload.seed,
                    "checkpoint": str(ckpt), "wall_s": round(time.monotonic() - t0, 1), "quota_s": cfg.quota_ms / 1000,
                    "first_turn_tokens": cfg.workload.first_turn_tokens,
                    "transport": results[0].transport if results else "tcp",
                    "workload": {**wl.config.to_dict(), "spec": cfg.to_dict()["workload"]}})
    if cfg.online:
        summary["arrivals"] = {"aps": cfg.online.aps, "seed": cfg.online.seed, "agents": len(wl.trajectories),
                               "unit": "agents per emulated second"}
    write_results(results, summary, run_dir, command)
    (run_dir / "report.md").write_text(f"# dualpath run (reproduce {cfg.key})\n\nProduced by `{command}`.\n\n```\n"
                                       + "\n".join(e2e_lines(summary)) + "\n```\n")
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
        except NeedsOnlineRunner as e:
            missing[cfg.key] = str(e)
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


def _search(plan: Plan, runs: dict[str, Run], runs_root: Path, command: str, progress, fresh: bool, runner,
            done: dict) -> None:
    """Bisect each mode's highest APS under the SLO between the grid's best pass and first fail."""
    grid = [c for c in plan.configs if c.online]
    if not grid:
        return
    for mode in plan.search.modes:
        pts = [(c.online.aps, online_mod.point(runs[c.key], mode)["meets_slo"]) for c in grid
               if c.key in runs and runs[c.key].has(mode)]
        template = grid[-1]  # its agents per APS: the longest arrival span's

        def evaluate(aps: float) -> bool:
            agents = max(template.workload.agents, round(aps * template.workload.agents / template.online.aps))
            cfg = replace(template, key=f"online/{mode}/aps={aps:.3g}", modes=(mode,),
                          workload=replace(template.workload, agents=agents),
                          online=replace(template.online, aps=round(aps, 3)), params={"aps": round(aps, 3)})
            runs[cfg.key] = _one(cfg, runs_root, command, progress, fresh, runner, done)
            return online_mod.point(runs[cfg.key], mode)["meets_slo"]

        online_mod.search(evaluate, pts, plan.search.rel_tol, plan.search.max_probes)
