"""A live testbed: `topo`, `up`, `status`, `exec`, `down`, `clean`, and `cluster prepare` for one spread over servers."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from testbed.topology import DEFAULT_TOPOLOGY, TopologyError
from testbed.cli.shared import _fabric, _fail, _need_root, _topology, app


@app.command()
def topo(topology: Path = typer.Argument(DEFAULT_TOPOLOGY, help="topology YAML")) -> None:
    """Validate a topology file; show its emulated rates, P/D bounds, target and time scale, and
    with servers: what each server holds and what must cross between them."""
    from dualpath.model.tiny import DEMO_KV_BYTES_PER_TOKEN
    from testbed import placement

    t = _topology(topology)
    for line in t.describe(DEMO_KV_BYTES_PER_TOKEN) + placement.describe(t):
        typer.echo(line)
    if placement.problems(t):
        raise typer.Exit(1)


@app.command()
def up(topology: Path = typer.Argument(DEFAULT_TOPOLOGY, help="topology YAML"),
       hold: float = typer.Option(0.0, help="seconds to keep it up (0: until Ctrl-C, at most 1 h)"),
       detach: bool = typer.Option(False, "--detach", help="return once it is up; it stays up until "
                                   "`dualpath down` (see `dualpath status`, `dualpath exec`)"),
       services: bool = typer.Option(False, "--services", help="with --detach: also start the store servers, "
                                     "host agents and engines"),
       checkpoint: Optional[Path] = typer.Option(None, help="with --services: the model the engines load "
                                                 "(default: the tiny demo model)"),
       as_json: bool = typer.Option(False, "--json", help="with --detach: print the state as JSON"),
       server: Optional[str] = typer.Option(None, "--server", hidden=True, help="with --detach: only the part "
                                            "the topology places on this server (the first server asks for it "
                                            "over SSH: testbed/fabric/remote.py)")) -> None:
    """Bring a topology up and print its namespaces and NICs; hold it until Ctrl-C, or --detach."""
    _need_root()
    if server is not None and (not detach or services):
        _fail("up: --server is for the first server's SSH call: it needs --detach and no --services")
    if not detach:
        for flag, given in (("--services", services), ("--json", as_json), ("--checkpoint", checkpoint)):
            if given:
                _fail(f"up: {flag} needs --detach (without it, up holds the fabric until Ctrl-C)")
        _up_hold(topology, hold)
        return
    from testbed.api import TestbedError
    from testbed.detach import lines, start_detached

    t0 = time.monotonic()
    try:
        st = start_detached(topology or DEFAULT_TOPOLOGY, services, checkpoint, server=server)
    except TestbedError as e:
        _fail(str(e), code=1)
    except TopologyError as e:
        _fail(str(e))
    took = time.monotonic() - t0
    if as_json:
        typer.echo(json.dumps({**st, "command_s": round(took, 3)}, indent=2))
        return
    for line in lines(st, "up"):
        typer.echo(line)
    typer.echo(f"up in {took:.2f}s (this command, start to return); `dualpath exec NODE -- CMD` runs in a "
               f"namespace, `dualpath down` tears down")


def _up_hold(topology: Path, hold: float) -> None:
    t = _topology(topology)
    t0 = time.monotonic()
    with _fabric(t, "up --hold") as fab:
        typer.echo(f"up in {time.monotonic() - t0:.2f}s")
        for ep in fab.endpoints:
            nics = ", ".join(f"{n.dev} {n.ip} {n.rate_bps / 1e6:g} Mbit/s" for n in ep.nics)
            typer.echo(f"  {ep.name:<10} {ep.kind:<7} {nics}")
        typer.echo("inspect with e.g. `ip netns exec dpt-p0e0 tc -s class show dev dpt-p0e0-cnic`; "
                   "Ctrl-C tears down")
        time.sleep(hold if hold > 0 else 3600)
    typer.echo("torn down")


@app.command()
def status(as_json: bool = typer.Option(False, "--json", help="print the state as JSON")) -> None:
    """Show the testbed that is up (started by `dualpath up --detach` or the Python API)."""
    from testbed.detach import lines, status as get_status

    st, what = get_status()
    if as_json:
        typer.echo(json.dumps({"status": what, **(st or {})}, indent=2))
    elif st is None:
        typer.echo("nothing is up" if what == "down" else "a testbed is starting")
    else:
        for line in lines(st, what):
            typer.echo(line)
        if what == "dead":
            typer.echo("  its owner is gone: `dualpath down` removes what it left")
    raise typer.Exit(0 if what == "up" else 1)


@app.command()
def down(force: bool = typer.Option(False, "--force", help="also remove a testbed whose owner is a live "
                                    "process using the Python API (it is removed from under it)")) -> None:
    """Tear down the testbed that `dualpath up --detach` started (or what a dead owner left)."""
    _need_root()
    from testbed.api import TestbedError
    from testbed.detach import down as do_down

    try:
        typer.echo(f"dualpath down: {do_down(force=force)}")
    except TestbedError as e:
        _fail(str(e), code=1)


@app.command("exec", context_settings={"allow_interspersed_args": False})
def exec_cmd(node: str = typer.Argument(..., help="a namespace of the testbed: p0e0, d0, s0, ... (see status)"),
             command: list[str] = typer.Argument(None, help="the command and its arguments (after --)"),
             ucx: bool = typer.Option(False, "--ucx", help="set UCX_TLS, UCX_NET_DEVICES, UCX_MODULES and "
                                      "UCX_TCP_PORT_RANGE so a NIXL/UCX program's bytes cross the node's NIC "
                                      "in the kv class"),
             traffic_class: Optional[str] = typer.Option(None, "--class", help="kv or model: every packet the "
                                                         "command sends is marked in that class (it runs with the "
                                                         "class's group), and its UCX settings are that class's"),
             python: bool = typer.Option(False, "--python", help="run the command with the testbed's own Python "
                                         "(its venv: NIXL, torch): dualpath exec NODE --python -- script.py")) -> None:
    """Run a command in a node's namespace of the testbed that is up: dualpath exec NODE -- CMD."""
    _need_root()
    from testbed.api import TestbedError
    from testbed.detach import ExecOptions, exec_argv, split_exec_args

    try:
        cmd, after = split_exec_args(list(command or []))
        if not cmd:
            _fail("exec: no command; usage: dualpath exec NODE -- CMD [ARGS...]")
        if traffic_class is not None and traffic_class not in ("kv", "model"):
            _fail(f"exec: --class {traffic_class[:40]!r}: choose kv or model")
    except TestbedError as e:
        _fail(str(e))  # a usage error
    opts = ExecOptions(ucx=ucx or after.ucx, traffic_class=traffic_class or after.traffic_class,
                       python=python or after.python)
    try:
        argv, env = exec_argv(node, cmd, opts)
    except TestbedError as e:
        _fail(str(e), code=1)
    sys.stdout.flush()
    try:
        os.execvpe(argv[0], argv, env)  # its exit status is ours
    except OSError as e:
        _fail(f"exec: {e.strerror}: {argv[0]}", code=1)


@app.command()
def clean(topology: Optional[Path] = typer.Argument(None, help="a topology that names servers: clean each of "
                                                    "them too (default: this machine only)")) -> None:
    """Remove anything the testbed left behind (matched by its dpt prefix only), here and on a
    topology's other servers."""
    _need_root()
    from testbed.fabric.cleanup import clean as do_clean
    from testbed.fabric.guest_server import stop_leftover_guests
    from testbed.fabric.remote import clean_remote, close_leftover_masters

    t = _topology(topology) if topology is not None else None
    failed = False
    for c in clean_remote(t) if t is not None else []:  # first: their tunnels lead here
        typer.echo(c.line())
        failed |= not c.ok
    do_clean(verbose=True)
    for sock in close_leftover_masters():
        typer.echo(f"closed a leftover ssh connection ({sock})")
    for folder in stop_leftover_guests():
        typer.echo(f"stopped a leftover cluster-test guest ({folder})")
    if failed:
        raise typer.Exit(1)


cluster_app = typer.Typer(no_args_is_help=True, help="A topology spread over several servers (docs/cluster.md).")
app.add_typer(cluster_app, name="cluster")


@cluster_app.command("prepare")
def cluster_prepare(topology: Path = typer.Argument(..., help="a topology YAML with servers: and place:")) -> None:
    """Check every server of a topology: SSH as root, the checkout and venv at the same path and
    commit, gretap, bridges and HTB in its kernel, its clock, and the path MTU the tunnels need.
    One line per check; exit 1 if any is a problem."""
    _need_root()
    from testbed import placement
    from testbed.fabric.remote import prepare

    t = _topology(topology)
    if not t.spec.servers:
        _fail(f"{topology}: names no servers, so there is nothing to prepare; see docs/cluster.md", code=2)
    checks = prepare(t)
    problems = placement.problems(t)
    for c in checks:
        typer.echo(c.line())
    for p in problems:
        typer.echo(f"topology: PROBLEM {p}")
    bad = sum(not c.ok for c in checks) + len(problems)
    typer.echo(f"{len(t.spec.servers)} servers, {len(checks)} checks: "
               + (f"{bad} problem(s)" if bad else "ready"))
    if bad:
        raise typer.Exit(1)
