"""`dualpath reproduce <id>`: one command per table and figure of the paper.

Layout: one module per id (table1 ... table3, fig7 ... fig15, bounds, isolation), each with
    plan(quick) -> Plan            the `dualpath run` configurations it needs (none for tables)
    reproduce(runs, out, quick)    the analysis and plots, pure functions of run folders -> Result
    run_config(cfg, dir, ...)      optional: an id whose run is not a plain `dualpath run` (isolation:
                                   three conditions on one cluster) runs its configs with this
and the common parts: runs (the run-folder loader), plan (configurations and run-time estimates),
execute (runs a plan on the testbed: root), online (the SLO, the steady-state rule, the APS
search), common (summary.json, report.md, headline rows), paper (the paper's numbers).

`reproduce_id` is the driver: it gets the runs (executes the plan, or reads given run folders),
calls the id's analysis and writes results/reproduce/<id>/<run-id>/. `reproduce_all` runs every
id and writes results/reproduce/index.md (index.py: every headline, both sizes).
"""
from __future__ import annotations

from dataclasses import replace

from testbed.reproduce.plan import SEED_KEY

import importlib
import time
from pathlib import Path
from typing import Callable, Iterable

IDS = ("table1", "table2", "table3", "fig7", "fig8", "fig9", "fig10", "fig11", "fig12", "fig13", "fig14", "fig15", "bounds",
       "isolation", "mooncake-trace")
DEFAULT_OUT = Path("results/reproduce")


class UnknownId(ValueError):
    pass


def module(fig_id: str):
    if fig_id not in IDS:
        raise UnknownId(f"unknown id {fig_id!r}; choose one of {', '.join(IDS)} (dualpath reproduce --list)")
    return importlib.import_module(f"testbed.reproduce.{fig_id.replace('-', '_')}")


def id_plan(fig_id: str, quick: bool = False, seed: int = 0, seeds: int | None = None):
    """The id's plan at its size, repeated on `seeds` workloads (None: the id's own default) and
    offset by `seed`. Only ids that pool repeats (POOLS_SEEDS) take more than one seed."""
    mod = module(fig_id)
    plan = mod.plan(quick)
    if seeds is not None:
        if seeds > 1 and not getattr(mod, "POOLS_SEEDS", False):
            pooling = ", ".join(i for i in IDS if getattr(module(i), "POOLS_SEEDS", False))
            raise ValueError(f"{fig_id} does not pool runs over seeds; --seeds > 1 is for {pooling} "
                             f"(--seed N runs any id on other workloads)")
        plan = plan.with_seeds(seeds)
    return plan.with_seed(seed)


def match_runs(plan, runs) -> tuple[dict, list]:
    """Map given run folders to the plan's configs: by digest (plan.json; one run can serve every
    config of its digest), then by key, then a lone folder without plan.json to a lone config.
    Returns ({key: Run}, the runs no config took)."""
    by_key, taken = {}, set()
    for cfg in plan.configs:
        r = next((r for r in runs if r.plan and r.plan.get("digest") == cfg.digest()), None) or \
            next((r for r in runs if r.plan and r.plan.get("key") == cfg.key), None)
        if r is not None:
            by_key[cfg.key] = r
            taken.add(id(r))
    if not by_key and len(plan.configs) == 1 and len(runs) == 1 and not runs[0].plan:
        by_key[plan.configs[0].key] = runs[0]
        taken.add(id(runs[0]))
    # a plain `dualpath run` folder (no plan.json): the one open config of its topology whose modes
    # it has, and whose agents and cold first turn agree with what the summary records
    for r in runs:
        if r.plan or id(r) in taken:
            continue
        # a plain run is of the plan's own workloads, not of a repeat on another seed
        fits = [c for c in plan.configs if c.key not in by_key and not c.online and SEED_KEY not in c.key
                and _fits(c, r)]
        if len({c.digest() for c in fits}) == 1:
            for c in fits:
                by_key[c.key] = r
            taken.add(id(r))
    return by_key, [r for r in runs if id(r) not in taken]


def _not_an_online_point(plan, run, taken: dict) -> str | None:
    """Why a run the plan's configs did not take is no point of its online curves (None: it is).
    A folder may hold both sizes' runs (--quick and full): a run whose key a run of this size
    already has, or a grid point or search probe with another size's agents per APS, belongs to
    the other."""
    from testbed.reproduce.execute import probe_agents
    from testbed.reproduce.online import grid_agents

    if not plan.needs_online or run.aps is None:
        return "not a run of this plan (no matching plan.json)"
    if run.key and run.key in taken:
        return f"{taken[run.key].path.name} is this size's run of {run.key}"
    agents = run.summary.get("trajectories")
    if run.key and run.key.count("/") == 1 and agents != grid_agents(run.aps, plan.quick):
        return (f"a grid point with {agents} agents at {run.aps:g} APS, where this size's grid runs "
                f"{grid_agents(run.aps, plan.quick)}")
    if plan.search and run.key and run.key.count("/") == 2 and agents != probe_agents(plan, run.aps):
        return (f"a search probe with {agents} agents at {run.aps:g} APS, where this size's search runs "
                f"{probe_agents(plan, run.aps)}")
    return None


def _fits(cfg, run) -> bool:
    s = run.summary
    # the link scale sets only the dilation (emulated times do not depend on it): a plain run of
    # the topology at its own scale answers what a config at another scale asks
    same = replace(cfg, topology_overrides={k: v for k, v in cfg.topology_overrides.items() if k != "scale"})
    try:
        name = same.topology_obj().name
    except Exception:
        return False
    return (name == run.topology and set(cfg.modes) <= set(run.modes)
            and s.get("trajectories", cfg.workload.agents) == cfg.workload.agents
            and s.get("first_turn_tokens", cfg.workload.first_turn_tokens) == cfg.workload.first_turn_tokens
            and (cfg.workload.preset == "demo") == ("workload" not in s or s["workload"].get("name") == "demo"))


def reproduce_id(fig_id: str, quick: bool = False, out_root: Path = DEFAULT_OUT, command: str = "",
                 run_folders: Iterable[Path] | None = None, fresh: bool = False,
                 progress: Callable[[str], None] = print, run_id: str | None = None, seed: int = 0,
                 seeds: int | None = None, archive: bool = False):
    """Reproduce one id; returns (output folder, Result). With `run_folders`, analyse those
    (nothing runs); otherwise execute the plan's runs first (needs root and the testbed).
    `seed` offsets every run's seeds (Plan.with_seed): workloads no committed run saw; `seeds`
    repeats every run on that many workloads (id_plan). `archive`: copy every run it uses, compactly,
    to <out_root>/<id>/runs/ and analyse those copies, so that the report names paths that can be
    committed with it (measure.runs.archive_run)."""
    from testbed.measure.runs import find_runs

    started = time.monotonic()
    mod = module(fig_id)
    plan = id_plan(fig_id, quick, seed, seeds)
    runs, missing = {}, {}
    if plan.configs:
        if run_folders is not None:
            runs, rest = match_runs(plan, find_runs(run_folders))
            for r in rest:
                why = _not_an_online_point(plan, r, runs)
                if why is None:  # a probe of the APS search, or any online run
                    runs[r.key or r.path.name] = r
                else:
                    progress(f"  {r.path}: {why}; ignored")
            any_online = any(r.aps is not None for r in runs.values())
            # an online figure reads whatever APS grid it is given: its own grid's keys are not required then
            missing = {c.key: "no such run folder given" for c in plan.configs
                       if c.key not in runs and not (c.online and any_online)}
        else:
            from testbed.reproduce.execute import execute

            extra = {"runner": mod.run_config} if hasattr(mod, "run_config") else {}
            runs, missing = execute(plan, Path(out_root) / "runs", command=command, progress=progress, fresh=fresh,
                                    **extra)
    if archive:
        from testbed.measure.runs import archive_run

        runs = {k: archive_run(r, Path(out_root) / fig_id / "runs") for k, r in runs.items()}
    out = Path(out_root) / fig_id / (run_id or time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    result = mod.reproduce(runs, out, quick=quick)
    result.missing.update({k: v for k, v in missing.items() if k not in result.missing})
    if not result.scale_down:
        result.scale_down = plan.scale_down
    lines = []
    if plan.configs:
        other = id_plan(fig_id, not quick, seed, seeds)
        lines = plan.lines() + [f"({'full' if quick else 'quick'} size: {len(other.configs)} run(s), estimated "
                                f"{other.estimate_s() / 60:.1f} min; `dualpath reproduce {fig_id}"
                                f"{'' if quick else ' --quick'} --plan` lists them)"]
    result.data["wall_s"] = round(time.monotonic() - started, 1)  # the index lists each id's time
    result.write(out, command, quick, plan.to_dict() if plan.configs else None, lines)
    return out, result


def reproduce_all(quick: bool = False, out_root: Path = DEFAULT_OUT, command: str = "",
                  progress: Callable[[str], None] = print, **kw) -> tuple[Path, dict[str, str]]:
    """Every id in turn (runs are reused across ids), then the index; an id that fails is named
    and the rest still run. Returns (index.md, {id: error})."""
    from testbed.reproduce.index import write_index

    failed: dict[str, str] = {}
    for fig_id in IDS:
        progress(f"== {fig_id} ==")
        try:
            reproduce_id(fig_id, quick=quick, out_root=out_root, command=command.replace(" all", f" {fig_id}", 1),
                         progress=progress, **kw)
        except (RuntimeError, ValueError, OSError) as e:
            failed[fig_id] = f"{type(e).__name__}: {e}"
            progress(f"  {fig_id} failed: {failed[fig_id]}")
    return write_index(out_root, IDS), failed
