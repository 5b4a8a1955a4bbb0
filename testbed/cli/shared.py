"""The `dualpath` application (`app`) and what its commands share: options, errors, the fabric of a foreground command."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from testbed.topology import DEFAULT_TOPOLOGY, TopologyError, load_topology


DEMO_TOPOLOGY = DEFAULT_TOPOLOGY.parent / "1p1d-io.yaml"  # I/O-bound: where DualPath matters


# The demo's link scale, above the file's 0.0016 (k = 4.88): the dilation absorbs the scale, so
# emulated times do not change, but the testbed's run time shrinks with k and the CPU's headroom
# with it. `dualpath calibrate scale topologies/1p1d-io.yaml --modes <the ladder>` found the
# ladder FAITHFUL up to x0.0032 and not at x0.0036 (results/calibrate/scale/20261207-070504):
# this is that edge less its 25 % margin (k = 3.05; it was 0.002, k = 3.9, before the search).
DEMO_SCALE = 0.00256


LADDER = "basic,layerwise,dualpath-rr,dualpath,oracle"  # the paper's ablation ladder


# The workload options `run` and `sim` share (dualpath/workload/spec.py: one vocabulary).
WORKLOAD_OPT = typer.Option(None, "--workload", help="a generated workload: demo, or the paper's trace sets 32K, 48K, "
                            "64K (lengths divided by --length-scale, default 32)")


TRACE_OPT = typer.Option(None, "--trace", help="replay a Mooncake-format JSONL trace: its sessions (recovered from "
                         "hash-id prefixes) as agents, arriving at its timestamps (docs: README, Workloads)")


LENGTH_SCALE_OPT = typer.Option(None, "--length-scale", help="divide every length by this: a preset's (default 32) "
                                "or a trace's (default 16: a 512-token trace block becomes one 32-token Full Block; must divide 512)")


APPEND_SCALE_OPT = typer.Option(None, "--append-scale", help="generated workloads: each turn's append length times this")


GEN_SCALE_OPT = typer.Option(None, "--gen-scale", help="each turn's generation length times this")


AGENTS_OPT = typer.Option(None, "--agents", min=1, max=1_000_000, help="agents: a generated workload's trajectories "
                          "(default 24), or a trace's first N sessions (default all)")


TRACE_LIMIT_OPT = typer.Option(None, "--trace-limit", min=1, max=10_000_000, help="--trace: its first N requests "
                               "(after --trace-window)")


TRACE_WINDOW_OPT = typer.Option(None, "--trace-window", help="--trace: A:B, the requests arriving in [A, B) seconds "
                                "of trace time")


OFFLINE_OPT = typer.Option(False, "--offline", help="--trace: every agent starts at once (no timestamps)")


TIME_SCALE_OPT = typer.Option(None, "--time-scale", help="--trace: trace seconds per emulated second (2: the trace "
                              "arrives twice as fast)")


app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
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


def _fabric(topo, kind: str, transport: str = "tcp"):
    """The fabric of a foreground command, holding the run directory (testbed.fabric.access.claimed_fabric):
    a testbed already up, or a dead one's leftovers, end the command with one line saying which."""
    from testbed.fabric.access import claimed_fabric

    return claimed_fabric(topo, transport, owner_kind=kind)


def _transport_opt(transport: str, mooncake: bool = False) -> str:
    """The --transport value, checked: tcp or rdma (NIXL over UCX), or, where `mooncake`, Mooncake's
    transfer engine, whose wheel must be installed (one line naming it, otherwise)."""
    choices = ("tcp", "rdma", "mooncake", "mooncake-rdma") if mooncake else ("tcp", "rdma")
    if transport not in choices:
        _fail(f"--transport: {transport!r} is not {', '.join(choices[:-1])} or {choices[-1]}")
    if transport.startswith("mooncake"):
        from dualpath.transport.mooncake import MissingMooncake, need_mooncake

        try:
            need_mooncake()
        except MissingMooncake as e:
            _fail(str(e))
    return transport


def _workload_options(workload, trace, length_scale, append_scale, gen_scale, agents, trace_limit, trace_window,
                      offline, time_scale, seed, first_turn_tokens=0, aps=0.0, trajectories=None):
    """The command line's workload options, checked for conflicts now (one line and exit 2):
    the resolved spec (dualpath.workload.spec), or None for the command's own default workload."""
    from dataclasses import replace

    from dualpath.workload.spec import WorkloadOptions, resolve

    if trajectories is not None and agents is not None and trajectories != agents:
        _fail(f"--trajectories {trajectories} and --agents {agents}: one count of agents; fix: give one of them")
    o = WorkloadOptions(workload, trace, length_scale, append_scale, gen_scale, agents, trace_limit, trace_window,
                        offline, time_scale, seed, first_turn_tokens, aps)
    if not o.given():
        return None
    if agents is None and trajectories is not None:
        o = replace(o, agents=trajectories)
    try:
        return resolve(o)
    except ValueError as e:
        _fail(str(e))


def _spec_workload(spec, geom, dilation: float):
    """The workload of a resolved spec: generated, or a trace replayed (its description printed).
    A bad trace or a spec that cannot run: one line and exit 2."""
    from dualpath.workload import TraceError, generate
    from dualpath.workload.spec import describe_scale
    from dualpath.workload.trace import TraceSpec, load_trace

    try:
        if isinstance(spec, TraceSpec):
            tw = load_trace(spec, geom.block_size)
        else:
            typer.echo(describe_scale(spec, geom.block_size))
            return generate(spec.config())
    except (TraceError, ValueError) as e:
        _fail(" ".join(str(e).split()))
    typer.echo(describe_scale(spec, geom.block_size))
    for line in _trace_lines(tw.stats()):
        typer.echo(line)
    return tw.workload(geom.block_size, dilation)


def _trace_lines(st: dict) -> list[str]:
    off = st["offered"]
    load = ("offline: every agent at once" if st["offline"] else
            f"offered load {off['agents_per_s']} agents and {off['tokens_per_s']} tokens per emulated second over "
            f"{st['span_emulated_s']:g} emulated s" if off["agents_per_s"] else "arrivals from its timestamps")
    return [f"trace {st['file']}: {st['requests']} requests, {st['sessions']} sessions ({st['chained_turns']} chained "
            f"turns, at most {st['turns_max']} per session), trace block hit rate {st['trace_block_hit_rate']:.4f}; {load}"]


def _demo_model() -> Path:
    from testbed.api import demo_checkpoint

    return demo_checkpoint()
