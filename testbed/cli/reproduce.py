"""`reproduce`: one table or figure of the paper."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from testbed.cli.shared import _fail, _need_root, app


@app.command()
def reproduce(fig: Optional[str] = typer.Argument(None, help="table1 ... table3, fig7 ... fig15, bounds, isolation (see "
                                                "--list); `all`: every id, then the index; `index`: the index only"),
              quick: bool = typer.Option(False, "--quick", help="the small size (about 10 min of runs per workload; --plan says how long)"),
              out: Path = typer.Option(Path("results/reproduce"), help="results go to OUT/<id>/<run-id>/, runs to OUT/runs/"),
              list_ids: bool = typer.Option(False, "--list", help="print the ids, one per line"),
              plan_only: bool = typer.Option(False, "--plan", help="print the runs it needs and their estimated time; run nothing"),
              runs: Optional[list[Path]] = typer.Option(None, "--runs", help="analyse these run folders (or folders "
                                                        "of them) instead of running; repeatable"),
              fresh: bool = typer.Option(False, help="run again even where a FAITHFUL run of the same config exists"),
              seed: int = typer.Option(0, min=0, max=1_000_000, help="offset every run's workload and arrival "
                                       "seeds by this: the figure on workloads no committed run saw"),
              seeds: Optional[int] = typer.Option(None, min=1, max=20, help="repeat every run on N workloads and pool "
                                                  "them (fig13 and fig14; default: 3 at --quick, 1 at full size)"),
              archive: bool = typer.Option(False, "--archive", help="copy the runs it uses, compactly, to "
                                           "OUT/<id>/runs/ and analyse those, so the report names paths that can be "
                                           "committed with it")) -> None:
    """Reproduce one table or figure of the paper: summary.json, PNGs and report.md."""
    from testbed.reproduce import IDS, UnknownId, id_plan, reproduce_id
    from testbed.measure.runs import RunError

    if list_ids:
        for i in IDS:
            typer.echo(i)
        return
    if not fig:
        _fail("reproduce: name an id (dualpath reproduce --list), `all`, or `index`")
    if fig == "index":  # from the reports on disk; runs nothing
        from testbed.reproduce.index import write_index

        typer.echo(f"index: {write_index(out, IDS)}")
        return
    if fig == "all":
        _reproduce_all(quick, out, fresh, seed, plan_only)
        return
    try:
        plan = id_plan(fig, quick, seed, seeds)
    except (UnknownId, ValueError) as e:
        _fail(f"reproduce: {e}")
    if plan_only:
        for line in plan.lines():
            typer.echo(line)
        return
    if plan.configs and runs is None:
        _need_root()  # something will run on the testbed
        for line in plan.lines():
            typer.echo(line)
    try:
        folder, result = reproduce_id(fig, quick=quick, out_root=out, command=" ".join(["dualpath", *sys.argv[1:]]),
                                      run_folders=runs, fresh=fresh, progress=typer.echo, seed=seed,
                                      seeds=seeds, archive=archive)
    except RunError as e:
        _fail(f"reproduce: {e}")
    for h in result.headline:
        def f(v):
            return "—" if v is None else f"{v:.4g}"
        ci = f" [{f(h.ci95[0])}, {f(h.ci95[1])}]" if h.ci95 else ""
        n = f" (n = {h.n})" if h.n is not None else ""
        typer.echo(f"  {h.name}: {'simulated' if h.simulated else 'testbed'} {f(h.testbed)}{ci}{n}, paper {f(h.paper)}, "
                   f"bound {f(h.bound)}")
    verdict = ("no runs needed" if result.no_runs_needed else "FAITHFUL" if result.faithful else
               "NOT FAITHFUL" if result.used else "no run available")
    typer.echo(f"{fig}: {verdict}")
    for why in result.shortfalls:
        typer.echo(f"  not a result: {why}")
    for why in sorted(set(result.missing.values())):
        keys = [k for k, v in result.missing.items() if v == why]
        typer.echo(f"  incomplete: {len(keys)} run(s) missing ({', '.join(keys)}): {why}")
    typer.echo(f"results: {folder}/summary.json, report.md, {', '.join(result.pngs) or 'no figure'}")
    raise typer.Exit(0 if result.is_result else 1)


def _reproduce_all(quick: bool, out: Path, fresh: bool, seed: int, plan_only: bool) -> None:
    """Every id (runs reused across ids), then results/reproduce/index.md."""
    from testbed.reproduce import IDS, id_plan, reproduce_all

    plans = [id_plan(i, quick, seed) for i in IDS]
    total = sum(p.estimate_s() for p in plans)
    for p in plans:
        typer.echo(f"{p.id}: {len(p.configs)} run(s), estimated {p.estimate_s() / 60:.1f} min")
    typer.echo(f"all ({'quick' if quick else 'full'}): estimated {total / 60:.0f} min before reuse")
    if plan_only:
        return
    _need_root()
    index, failed = reproduce_all(quick=quick, out_root=out, command=" ".join(["dualpath", *sys.argv[1:]]),
                                  progress=typer.echo, fresh=fresh, seed=seed)
    for fig_id, why in failed.items():
        typer.echo(f"  {fig_id} failed: {why}")
    typer.echo(f"index: {index}")
    raise typer.Exit(1 if failed else 0)
