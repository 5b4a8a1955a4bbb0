"""The `dualpath` command line."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from testbed.topology import TopologyError, load_topology

DEFAULT_TOPOLOGY = Path(__file__).resolve().parent.parent / "topologies" / "1p1d.yaml"

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="DualPath testbed: run DualPath for real on one Linux machine.")


def _fail(msg: str, code: int = 2) -> None:
    typer.echo(f"dualpath: {msg}", err=True)
    raise typer.Exit(code)


def _need_root() -> None:
    if os.geteuid() != 0:
        _fail("this command needs root (it creates network namespaces and tc qdiscs); "
              "run it with sudo", code=1)


def _on_signal(signum: int, _frame: object) -> None:
    # SIGTERM unwinds like Ctrl-C so every `with Fabric(...)` tears down.
    raise KeyboardInterrupt(f"signal {signum}")


def _topology(path: Optional[Path]):
    try:
        return load_topology(path or DEFAULT_TOPOLOGY)
    except TopologyError as e:
        _fail(str(e))


def _fabric(topo):
    from testbed.cleanup import find_leftovers
    from testbed.fabric import Fabric

    left = find_leftovers()
    if not left.empty():
        _fail(f"leftovers of an earlier run exist ({left.summary()}); run `dualpath clean` first")
    return Fabric(topo)


@app.command()
def topo(topology: Path = typer.Argument(DEFAULT_TOPOLOGY, help="topology YAML")) -> None:
    """Validate a topology file and show its emulated rates and P/D bounds."""
    for line in _topology(topology).describe():
        typer.echo(line)


@app.command()
def up(topology: Path = typer.Argument(DEFAULT_TOPOLOGY, help="topology YAML"),
       hold: float = typer.Option(0.0, help="seconds to keep it up (0: until Ctrl-C, at most 1 h)")) -> None:
    """Bring a topology up, print its namespaces and NICs, tear it down on exit."""
    _need_root()
    t = _topology(topology)
    t0 = time.monotonic()
    with _fabric(t) as fab:
        typer.echo(f"up in {time.monotonic() - t0:.2f}s")
        for ep in fab.endpoints:
            nics = ", ".join(f"{n.dev} {n.ip} {n.rate_bps / 1e6:g} Mbit/s" for n in ep.nics)
            typer.echo(f"  {ep.name:<10} {ep.kind:<7} {nics}")
        typer.echo("inspect with e.g. `ip netns exec dpt-p0e0 tc -s class show dev dpt-p0e0-cnic`; "
                   "Ctrl-C tears down")
        time.sleep(hold if hold > 0 else 3600)
    typer.echo("torn down")


@app.command()
def check(topology: Path = typer.Argument(DEFAULT_TOPOLOGY, help="topology YAML"),
          as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
          rdma: bool = typer.Option(False, "--rdma", help="only the RDMA preflight (pyverbs)"),
          seconds: float = typer.Option(3.0, min=1.0, max=30.0, help="seconds per iperf3 flow"),
          out: Optional[Path] = typer.Option(None, help="also write summary.json and report.md here")) -> None:
    """Calibrate every NIC kind with iperf3 and test QoS priority isolation."""
    if rdma:
        from testbed.rdma_preflight import rdma_preflight

        rep = rdma_preflight()
        if as_json:
            typer.echo(json.dumps(rep, indent=2))
        else:
            typer.echo(f"RDMA: {'available' if rep['available'] else 'NOT available'}")
            for dev in rep["devices"]:
                typer.echo(f"  {dev}")
            if rep["reason"]:
                typer.echo(f"  {rep['reason']}")
        raise typer.Exit(0 if rep["available"] else 1)
    _need_root()
    from testbed.check import check as run_check
    from testbed.report import check_lines, write_check

    t = _topology(topology)
    progress = (lambda m: typer.echo(m, err=True)) if as_json else typer.echo
    with _fabric(t) as fab:
        progress(f"checking {t.name}: {len(fab.nics)} NICs")
        report = run_check(fab, seconds=seconds, progress=progress)
    if out:
        write_check(report, out, command=" ".join(["dualpath", *sys.argv[1:]]))
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        for line in check_lines(report):
            typer.echo(line)
    raise typer.Exit(0 if report.ok else 1)


@app.command()
def clean() -> None:
    """Remove anything the testbed left behind (matched by its dpt prefix only)."""
    _need_root()
    from testbed.cleanup import clean as do_clean

    do_clean(verbose=True)


@app.command()
def demo(out: Path = typer.Option(Path("results/check"), help="where the run's folder goes")) -> None:
    """The main job: bring up 1p1d, run the check, print a summary and where it went."""
    _need_root()
    from testbed.check import check as run_check
    from testbed.report import check_lines, write_check

    t = _topology(DEFAULT_TOPOLOGY)
    run_dir = out / time.strftime("%Y%m%d-%H%M%S")
    with _fabric(t) as fab:
        for line in t.describe():
            typer.echo(line)
        report = run_check(fab, progress=typer.echo)
    write_check(report, run_dir, command="make demo  (dualpath demo)")
    for line in check_lines(report):
        typer.echo(line)
    typer.echo(f"results: {run_dir}/summary.json, {run_dir}/report.md")
    raise typer.Exit(0 if report.ok else 1)


def main() -> None:
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        app()
    except KeyboardInterrupt:
        typer.echo("dualpath: interrupted; torn down", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
