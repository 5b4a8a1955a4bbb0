"""`check`, `bench` and `profile`: the emulation measured against real tools, and its own cost."""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from testbed.topology import DEFAULT_TOPOLOGY
from testbed.cli.shared import _fabric, _fail, _need_root, _topology, _transport_opt, app, _demo_model


@app.command()
def check(topology: Path = typer.Argument(DEFAULT_TOPOLOGY, help="topology YAML"),
          as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
          rdma: bool = typer.Option(False, "--rdma", help="RDMA only: bring the topology up with an rxe device "
                                    "per engine and host namespace, list them (pyverbs), and prove one NIXL "
                                    "READ/WRITE crossed them (hw_counters)"),
          seconds: float = typer.Option(3.0, min=1.0, max=30.0, help="seconds per iperf3 flow"),
          out: Optional[Path] = typer.Option(None, help="also write summary.json and report.md here")) -> None:
    """Calibrate every NIC kind with iperf3 and test QoS priority isolation."""
    if rdma:
        _check_rdma(topology, as_json, out)
    _need_root()
    from testbed.calibrate.check import check as run_check
    from testbed.calibrate.report import check_lines, write_check

    t = _topology(topology)
    progress = (lambda m: typer.echo(m, err=True)) if as_json else typer.echo
    with _fabric(t, "check") as fab:
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


def _check_rdma(topology: Optional[Path], as_json: bool, out: Optional[Path]) -> None:
    """`dualpath check --rdma`: proof of transport, not configuration (see rdma_check)."""
    from dualpath.transport.env import RdmaUnavailableError
    from testbed.calibrate.rdma_preflight import rdma_check, rdma_preflight

    progress = (lambda m: typer.echo(m, err=True)) if as_json else typer.echo
    if os.geteuid() != 0:
        rep = rdma_preflight()
        rep.update(rdma_proven=False, reason=(rep["reason"] + "; " if rep["reason"] else "")
                   + "proving RDMA needs root (it brings the topology up with an rxe device per namespace)")
    else:
        t = _topology(topology)
        try:
            with _fabric(t, "check --rdma", "rdma") as fab:
                progress(f"checking RDMA on {t.name}: {len(fab.rxe)} rxe devices")
                rep = rdma_check(fab, progress)
        except RdmaUnavailableError as e:
            rep = {"available": False, "rdma_proven": False, "devices": [], "reason": str(e)}
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "rdma.json").write_text(json.dumps(rep, indent=2, default=str) + "\n")
    if as_json:
        typer.echo(json.dumps(rep, indent=2, default=str))
    else:
        typer.echo(f"RDMA: {'PROVEN' if rep['rdma_proven'] else 'NOT proven'}")
        for dev in rep.get("devices", []):
            typer.echo(f"  {dev}")
        p = rep.get("rdma")
        if p:
            c = rep["class_bytes_into_initiator"]
            typer.echo(f"  NIXL READ/WRITE check: byte-exact {rep['transport_check']['bytes_exact']}, "
                       f"{sum((rep['transport_check']['bytes_moved'] or {}).values())} bytes; rxe sent_pkts "
                       f"+{p['rxe_sent_pkts']}, rcvd_pkts +{p['rxe_rcvd_pkts']}; HTB into the initiator: kv "
                       f"{c['kv']} bytes, model {c['model']}")
            for d in p["devices"]:
                typer.echo(f"    {d['device']}: {d['kv_bytes_sent']} KV bytes to send, sent_pkts +{d['sent_pkts']} "
                           f"(>= {d['min_pkts']} needed): {'ok' if d['proven'] else d['why']}")
        fc = rep.get("fallback_control")
        if fc:
            typer.echo(f"  the same check without the system libibverbs preloaded: "
                       + (f"caught ({'UCX refused to start: no usable transport' if fc['how'] == 'refused' else 'by the rxe counters'})"
                          if fc["caught"] else f"NOT caught: {fc.get('error') or 'it passed'}"))
        mc = rep.get("mooncake")
        if mc:
            typer.echo("  Mooncake READ/WRITE over rxe (its RDMA transport): " + (
                mc["skipped"] if "skipped" in mc else
                f"byte-exact {mc['bytes_exact']}, proven by the rxe counters {mc['rdma_proven']}"
                + (f" (rxe sent_pkts +{mc['rdma']['rxe_sent_pkts']}; HTB into the initiator: kv "
                   f"{mc['class_bytes_into_initiator']['kv']} bytes, model {mc['class_bytes_into_initiator']['model']})"
                   if "rdma" in mc else f": {mc.get('error')}")))
        if rep.get("reason") and not rep["rdma_proven"]:
            typer.echo(f"  {rep['reason']}")
    if not rep["rdma_proven"] and not as_json:
        typer.echo(f"dualpath: RDMA not proven: {rep.get('reason', '')}", err=True)
    raise typer.Exit(0 if rep["rdma_proven"] else 1)


@app.command()
def bench(what: str = typer.Argument(..., help="transport, store, burst or ucx-perftest"),
          topology: Path = typer.Argument(DEFAULT_TOPOLOGY, help="topology YAML"),
          out: Path = typer.Option(Path("results/bench"), help="where the run's folder goes"),
          transport: str = typer.Option("tcp", help="transport: tcp, or rdma (Soft-RoCE: NIXL against perftest "
                                        "on the same rxe link, proven by its hw_counters), or mooncake (Mooncake's "
                                        "transfer engine over TCP, and its transfer_engine_bench)")) -> None:
    """Data-plane benchmarks: NIXL vs iperf3 (unshaped and at the CNIC rate); store vs iperf3 and fio;
    burst: how far past its HTB bucket an idle shaped NIC lets a fresh transfer go (for `sim --calibrate --burst`);
    ucx-perftest: UCX's own benchmark (tag, put, get) across two engines vs iperf3, in each traffic class."""
    if what not in ("transport", "store", "burst", "ucx-perftest"):
        _fail(f"bench: unknown target {what!r}; choose transport, store, burst or ucx-perftest")
    if what == "ucx-perftest":
        from testbed.calibrate.benches.ucx_perftest import MissingTool, need_tool

        try:
            need_tool()
        except MissingTool as e:
            _fail(str(e))
    mooncake = _transport_opt(transport, mooncake=True).startswith("mooncake")
    if mooncake:
        if what != "transport":
            _fail("bench: --transport mooncake applies to `bench transport` only")
        transport = "tcp"  # the fabric's own; Mooncake brings its TCP transport
    if transport == "rdma" and what != "transport":
        _fail("bench: --transport rdma applies to `bench transport` only (the store speaks TCP)")
    _need_root()
    from testbed.calibrate.benches import bench_store, bench_transport

    t = _topology(topology)
    run_id = time.strftime("%Y%m%d-%H%M%S")
    scratch = Path("/var/tmp") / f"dpt-run-{run_id}"
    scratch.mkdir(parents=True, exist_ok=True)
    with _fabric(t, "bench", transport) as fab:
        if what == "burst":
            from testbed.calibrate.benches.burst import bench_burst

            res = {"topology": t.name, **bench_burst(fab, t.spec.mtu, typer.echo)}
        elif what == "ucx-perftest":
            from testbed.calibrate.benches.ucx_perftest import bench_ucx_perftest

            res = {"topology": t.name, **bench_ucx_perftest(fab, typer.echo)}
        elif mooncake:
            from testbed.calibrate.benches.transport_mooncake import bench_transport_mooncake

            res = {"topology": t.name, **bench_transport_mooncake(fab, scratch, typer.echo)}
        else:
            res = bench_transport(fab, typer.echo) if what == "transport" else bench_store(fab, scratch, typer.echo)
    shutil.rmtree(scratch, ignore_errors=True)
    run_dir = out / what / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    command = " ".join(["dualpath", *sys.argv[1:]])
    (run_dir / "summary.json").write_text(json.dumps({"command": command, **res}, indent=2) + "\n")
    lines = _bench_lines(what, res, mooncake)
    (run_dir / "report.md").write_text(f"# dualpath bench {what}\n\nProduced by `{command}`.\n\n```\n"
                                       + "\n".join(lines) + "\n```\n")
    for line in lines:
        typer.echo(line)
    typer.echo(f"results: {run_dir}/summary.json, report.md")
    if transport == "rdma" and not res.get("rdma_proven"):
        _fail(res.get("error") or "the rxe counters do not prove that RDMA carried the bytes", code=1)


def _bench_lines(what: str, res: dict, mooncake: bool) -> list[str]:
    """A bench's report, in the words of the module that ran it."""
    if what == "burst":
        from testbed.calibrate.benches.burst import burst_lines

        return burst_lines(res)
    if what == "ucx-perftest":
        from testbed.calibrate.benches.ucx_perftest import lines

        return lines(res)
    if mooncake:
        from testbed.calibrate.benches.transport_mooncake import lines

        return lines(res)
    from testbed.calibrate.report import bench_lines

    return bench_lines(what, res)


profile_app = typer.Typer(no_args_is_help=True, help="Where time and CPU go: the engine's cost model "
                          "(`model`), a run's CPU by process and activity against its floor (`run`).")
app.add_typer(profile_app, name="profile")


@profile_app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def profile_run(ctx: typer.Context,
                topology: Path = typer.Argument(DEFAULT_TOPOLOGY, help="topology YAML"),
                out: Path = typer.Option(Path("results/profile"), help="the profile goes to OUT/run/<run-id>/"),
                rate: int = typer.Option(10, min=1, max=500, help="py-spy's samples per second per process "
                                         "(its own CPU grows with it: about 0.5 of a core at 50 here)"),
                checkout: Optional[Path] = typer.Option(None, help="profile the code of this checkout (another "
                                                        "version, e.g. a git worktree; default: this one)"),
                floor: bool = typer.Option(True, "--floor/--no-floor", help="measure the physical floor after the "
                                           "run: its tokens through the bare model, iperf3's CPU per GB"),
                iperf_s: float = typer.Option(3.0, min=0.5, max=30.0, help="seconds of each floor iperf3 flow")) -> None:
    """A `dualpath run` under a sampling profiler: CPU seconds per emulated second by process role
    and activity, beside the floor. Every option not named here goes to `dualpath run`."""
    from testbed.calibrate.run_profile import ProfileError, profile
    from testbed.measure.cpu_profile import report_lines
    from testbed.measure.plots import cpu_profile_bars

    _need_root()
    _topology(topology)  # a bad file: one line, before anything starts
    code = (checkout or Path(__file__).resolve().parents[2]).resolve()
    if not any((code / "testbed" / p).exists() for p in ("cli/__main__.py", "cli.py")):  # cli.py: before 2026-12-06
        _fail(f"--checkout {code}: not a checkout of the testbed (no testbed/cli)")
    if "--out" in ctx.args:
        _fail("profile run: --out is the profile's; the run it watches goes to OUT/run/<run-id>/run/")
    run_dir = out / "run" / time.strftime("%Y%m%d-%H%M%S")
    try:
        res = profile(topology.resolve(), list(ctx.args), run_dir, checkout=code, rate=rate, floor=floor,
                      iperf_s=iperf_s, progress=typer.echo)
    except ProfileError as e:
        _fail(str(e), code=1)
    command = " ".join(["dualpath", *sys.argv[1:]])
    res = {"command": command, **res}
    (run_dir / "summary.json").write_text(json.dumps(res, indent=2) + "\n")
    lines = report_lines(res)
    fl = res.get("floor") or {}
    png = cpu_profile_bars(res["by_role_and_activity"], res["emulated_s"] or 1.0, fl.get("cpu_s"),
                           run_dir / "cpu.png", f"Produced by `{command}`; activities from py-spy's samples "
                           f"at {rate} Hz, totals from each process's counters and the kernel's softirq time.")
    (run_dir / "report.md").write_text(f"# dualpath profile run\n\nProduced by `{command}` on the code of "
                                       f"{code}.\n\n![CPU by role and activity]({png})\n\n```\n"
                                       + "\n".join(lines) + "\n```\n\nStacks (py-spy's collapsed format, for "
                                       "speedscope or flamegraph.pl): stacks.txt\n")
    for line in lines:
        typer.echo(line)
    typer.echo(f"results: {run_dir}/summary.json, report.md, cpu.png, stacks.txt")


@profile_app.command("model")
def profile_model(checkpoint: Optional[Path] = typer.Option(None, help="checkpoint directory (default: the demo model)"),
                  quota: float = typer.Option(0.3, min=0.001, help="compute quota, seconds of attention per forward"),
                  out: Path = typer.Option(Path("results/profile"), help="the fit goes to OUT/model/<run-id>/")) -> None:
    """Fit the compute-quota cost model on the engine's own prefill loop; derive beta."""
    from dualpath.model import CheckpointError
    from testbed.calibrate.profile import profile

    ckpt = checkpoint or _demo_model()
    try:
        res = profile(ckpt, quota_s=quota)
    except CheckpointError as e:
        _fail(str(e))
    run_dir = out / "model" / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    command = " ".join(["dualpath", *sys.argv[1:]])
    (run_dir / "summary.json").write_text(json.dumps({"command": command, **res}, indent=2) + "\n")
    m = res["cost_model"]
    typer.echo(f"cost model: t = {m['intercept']:.2e} + {m['per_new']:.2e}*new + {m['per_pair']:.2e}*pairs "
               f"+ {m['per_cached']:.2e}*cached  (s)")
    typer.echo(f"held-out median relative error {res['median_rel_error_held_out']:.1%}; prefill "
               f"{res['prefill_tokens_per_s']:.0f} tokens/s, so beta = 5 s = {res['beta_tokens_at_5s']:.0f} tokens")
    ex = res["example_chunk"]
    typer.echo(f"a request of {ex['new']} new tokens after {ex['cached']} cached overflows the {quota:g} s quota: "
               f"its first chunk is {ex['largest_chunk_in_quota']} tokens")
    typer.echo(f"results: {run_dir}/summary.json")


calibrate_app = typer.Typer(no_args_is_help=True, help="Settings found by measurement: the smallest faithful "
                            "dilation (`scale`).")
app.add_typer(calibrate_app, name="calibrate")


@calibrate_app.command("scale")
def calibrate_scale_cmd(topology: Path = typer.Argument(DEFAULT_TOPOLOGY, help="topology YAML"),
                        modes: str = typer.Option("dualpath", help="comma-separated modes each probe runs (dualpath: "
                                                  "the mode whose engines overlap most)"),
                        agents: int = typer.Option(24, min=1, max=1000, help="the demo workload's agents per probe"),
                        seed: int = typer.Option(0, help="workload seed"),
                        margin: float = typer.Option(0.25, min=0.0, max=4.0, help="recommend the FAITHFUL edge / "
                                                     "(1 + margin)"),
                        max_probes: int = typer.Option(6, min=1, max=20, help="runs at most"),
                        rel_tol: float = typer.Option(0.1, min=0.01, max=1.0, help="stop when the bracket is this "
                                                      "close"),
                        out: Path = typer.Option(Path("results/calibrate/scale"), help="the search goes to "
                                                 "OUT/<run-id>/"),
                        report: Optional[Path] = typer.Option(None, help="write an earlier search's report.md "
                                                              "again from its summary.json (runs nothing)")) -> None:
    """The largest link scale (smallest dilation) at which the topology's run stays FAITHFUL, less a margin."""
    from testbed.reproduce.calibrate_scale import calibrate_scale, report_lines, write
    from testbed.cluster.conductor import MODES

    if report is not None:
        try:
            res = json.loads((report / "summary.json").read_text())
        except (OSError, ValueError) as e:
            _fail(f"--report {report}: no readable summary.json ({e})")
        write(res, report)
        for line in report_lines(res):
            typer.echo(line)
        return
    _need_root()
    _topology(topology)
    mode_list = tuple(m for m in modes.split(",") if m)
    bad = [m for m in mode_list if m not in MODES]
    if not mode_list or bad:
        _fail(f"--modes {modes!r}: expected some of {', '.join(MODES)}")
    run_dir = out / time.strftime("%Y%m%d-%H%M%S")
    res = calibrate_scale(topology, run_dir, modes=mode_list, agents=agents, seed=seed, margin=margin,
                          max_probes=max_probes, rel_tol=rel_tol, command=" ".join(["dualpath", *sys.argv[1:]]),
                          progress=typer.echo)
    write(res, run_dir)
    for line in report_lines(res):
        typer.echo(line)
    typer.echo(f"results: {run_dir}/summary.json, report.md")
    if not res["recommended"]["scale"]:
        raise typer.Exit(1)
