"""The end-to-end experiment: a set of agentic trajectories through the cluster in every mode.

Data flows one way: topology -> fabric -> node processes -> per-request records
and kernel counters -> verification and accounting -> results/<experiment>/<run>/.
"""
from __future__ import annotations

import asyncio
import functools
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from dualpath.accounting import compare, expected_totals
from dualpath.kv.layouts import BlockGeometry
from dualpath.scheduler.core import Scheduler
from dualpath.scheduler.thresholds import PAPER_ALPHA_S, PAPER_BETA_S, Profile
from dualpath.workload import Workload
from testbed.fabric import counters
from testbed.cluster.processes import CONDUCTOR_IP, Cluster
from dualpath.lifecycle.record import RequestRecord
from testbed.cluster.conductor import MODES, Conductor
from testbed.cluster.modes import PATH_POLICY
from testbed.fabric.access import claimed_fabric
from testbed.fabric.network import Fabric
from testbed.cluster.faults import (DISK_FULL_S, DISK_FULL_TMPFS_BYTES, RESTART_DELAY_S, FaultLog, FaultSpec, Injector,
                                   check_on_first_server, lost_blocks)
from dualpath.store.keys import chain_keys
from dualpath.control import ControlError
from testbed.measure.fidelity import link_use, tolerated as tolerated_overruns, verdict as fidelity_verdict
from testbed.measure.monitor import Monitor, ServersCpu
from testbed.fabric.remote import cpu_fields_of
from testbed.paths import REPO, code_version, shown_path
from testbed.cluster.runclock import RUN_BLOCK_TOKENS, RunClock, run_geometry
from testbed.topology import Topology
from testbed.placement import placement, spans_servers
from testbed.cluster.scheduling import STALE_AFTER_S, ServiceRouter
from testbed.experiments.results import ModeResult, TOLERANCE, _request_bytes, conversation, summarize, write_results


if TYPE_CHECKING:
    from dualpath.kv.plugin import ConnectorRef


def _lost_after_faults(log: FaultLog, cluster: Cluster) -> dict[str, int]:
    """Per injected fault, how many blocks acknowledged before it do not read back whole."""
    roots, lost = [s.root for s in cluster.stores], {}
    for f in log.faults:
        if f.t_injected is not None:
            bad = lost_blocks(roots, f.acked_before)
            lost[f.label] = len(bad)
            if bad:
                f.detail["lost_examples"] = bad[:3]
    return lost


async def _engine_logs(cluster: Cluster, t_origin: float) -> tuple[list[dict], dict[str, list]]:
    """The decode engines' steps (times from `t_origin`) and the host agents' store reads."""
    async def each(names: list[str], cmd: str, key: str) -> dict[str, list]:
        out = {}
        for n in names:  # a process a fault killed has nothing to say
            if cluster.procs[n].alive():
                try:
                    out[n] = (await cluster.clients[n].call(cmd))[key]
                except ControlError:
                    pass
        return out

    def origin(name: str) -> float:  # the run's origin on that process's clock
        return t_origin + cluster.clock_offset(name)

    steps = [{**x, "de": de, "t_start": x["t_start"] - origin(de), "t_end": x["t_end"] - origin(de)}
             for de, xs in (await each(cluster.engines("decode"), "steps", "steps")).items() for x in xs]
    loads = {h: [[t0 - cluster.clock_offset(h), t1 - cluster.clock_offset(h), n] for t0, t1, n in xs]
             for h, xs in (await each(list(cluster.loaders), "read_log", "loads")).items()}
    return steps, loads


def _run_mode(cluster: Cluster, fab: Fabric, geom: BlockGeometry, workload: Workload, mode: str,
              namespace: bytes, progress: Callable[[str], None], quota_s: float, clock: "RunClock",
              faults: tuple[FaultSpec, ...] = (), seed: int = 0) -> ModeResult:
    recs: list[RequestRecord] = []
    arrivals: dict[int, float] = {}  # trajectory -> when its agent arrived (testbed s)
    done = [0]
    total = sum(len(t.turns) for t in workload.trajectories)

    def on_record(r: RequestRecord) -> None:
        if r.trajectory >= 0:
            done[0] += 1
            if done[0] % max(total // 10, 1) == 0 or done[0] == total:
                progress(f"    {mode}: {done[0]}/{total} requests")

    async def go() -> tuple[float, RequestRecord, int, Conductor, dict, tuple[float, float], list, dict]:
        router = _router(cluster, fab, geom, mode, clock)
        await router.start()
        co = Conductor(cluster, geom, mode, namespace, router, on_record=on_record,
                       cost_model=clock.prefill_cost or cluster.cost_model, quota_s=quota_s, faults=log, hbm=clock.hbm)
        sent0 = cluster.control_bytes()
        injector = inject = None
        try:
            warm = [await co.warm(list(p), n) for n, p in enumerate(workload.warmups())]
            bad = next((w for w in warm if w.error), None)
            if bad is not None:
                raise RuntimeError(f"warm-up failed: {bad.error}")
            t0 = co._now()
            if log:  # the faults count from the mode's first request
                injector = Injector(log, cluster, fab, co, clock.dilation, seed,
                                    chain_keys(list(workload.system_prompt), geom.block_size, namespace=namespace),
                                    progress)
                inject = asyncio.ensure_future(injector.run(t0))
            per = await asyncio.gather(*[  # offline: every agent at t0; online: at its arrival time
                co.trajectory(t, start_at=t0 + (t.arrival_s or 0.0))
                for t in workload.trajectories])
        finally:
            if inject is not None:  # faults due after the last request are not injected (and say so)
                inject.cancel()
                await asyncio.gather(inject, return_exceptions=True)
            if injector is not None:
                await injector.heal()
            await router.stop()
        if log:
            lost.update(_lost_after_faults(log, cluster))
        for p in per:
            recs.extend(p)
        t1 = max(r.t_done for r in recs)
        arrivals.update({t.id: t0 + (t.arrival_s or 0.0) for t in workload.trajectories})
        app = cluster.control_bytes() - sent0
        steps, loads = await _engine_logs(cluster, co.t0)
        return t1 - t0, warm, app, co, router.stats(), (co.t0 + t0, co.t0 + t1), steps, loads

    log = FaultLog(list(faults)) if faults else None
    lost: dict[str, int] = {}
    devs = [n.bridge_dev for n in fab.nics]
    before = counters.snapshot(fab)
    dscp0 = counters.dscp_counters(fab)
    tc0 = time.monotonic()
    pids = cluster.pids()
    others = ServersCpu({v.name: functools.partial(cpu_fields_of, v) for v in fab.remotes})  # read where they are
    with Monitor(devs, interval_s=0.25, pids=list(pids)) as mon, others:
        jct, warm, app_bytes, co, decisions, window, steps, loads = cluster.run(go())
    snap = counters.delta(counters.snapshot(fab), before)
    res = ModeResult(mode, recs, jct, snap, app_bytes,
                     mon.cpu_busy(), mon.cpu_peak(mon.samples[0].t, mon.samples[-1].t, 1.0))
    res.dscp = counters.dscp_delta(counters.dscp_counters(fab), dscp0)
    res.counters_s = time.monotonic() - tc0
    res.cpu_own, res.cpu_steal, res.cpu_threads = mon.cpu_own(), mon.cpu_steal(), mon.cpu_by_thread(pids)
    res.server_cpu, res.clock_sync = others.busy(), dict(cluster.clock_sync)
    res.samples = _time_series(mon, fab, co.t0)
    res.batches = co.batches
    res.agent_jct_s = [max(r.t_done for r in recs if r.trajectory == tid) - t for tid, t in arrivals.items()
                       if any(r.trajectory == tid for r in recs)]
    res.scheduler = decisions
    res.steps = steps
    res.links = [link_use(f"{node}/snic", fab.topo.snic_bps, window, [tuple(x) for x in node_loads],
                          fab.topo.spec.mtu) for node, node_loads in sorted(loads.items())]
    _judge(res, fab, snap, [b["timing"] for b in co.batches], [*warm, *recs])
    res.fault_log, res.lost = log, lost
    return res


def _judge(res: ModeResult, fab: Fabric, snap: counters.Snapshot, timings: list[dict], requests: list[RequestRecord]) -> None:
    """The mode's fidelity verdict, and its KV bytes per NIC against the path definitions."""
    res.faithful, res.unfaithful_reasons = fidelity_verdict(timings, res.steps, res.cpu_busy, res.links, res.cpu_own,
                                                            jct_s=res.jct_s, cpu_steal=res.cpu_steal,
                                                            server_cpu=res.server_cpu)
    res.fidelity_notes = tolerated_overruns(timings, res.steps) if res.faithful else []
    expected = expected_totals(_request_bytes(r, res.mode) for r in requests if not r.error)
    res.accounting = compare(expected, counters.first_sent(snap), tolerance=TOLERANCE)
    if fab.transport == "rdma" and res.mode != "oracle":  # the oracle moves no KV: nothing to prove
        res.rdma = rdma_proof(fab, snap, expected)


def rdma_proof(fab: Fabric, snap: counters.Snapshot, expected: dict) -> dict[str, Any]:
    """Did the KV cross RDMA? Per rxe device, the KV bytes its NIC had to send by the path
    definitions against its hw_counters (sent_pkts), and the share of the NIC's kv-class
    packets that were RoCE (dualpath.transport.rdma.prove)."""
    from dualpath.transport.rdma import prove

    sent, kv_class = {}, {}
    for nic in fab.rdma_nics():
        dev, key = fab.rxe_of(nic), (nic.ns, nic.kind, "tx")
        sent[dev] = expected.get(key, 0)
        kv_class[dev] = snap.kv_pkts.get(key, 0)
    return prove(snap.rxe, sent, fab.rdma_mtu(), kv_class if fab.qos else None)


def _time_series(mon: Monitor, fab: Fabric, t0: float) -> list[dict]:
    """The monitor's samples in the NICs' own view: t (testbed s since the mode's start), the CPU
    busy share since the previous sample, and per NIC its cumulative rx and tx bytes (the
    bridge end's tx is what the NIC received)."""
    names = {n.bridge_dev: f"{n.ns}/{n.kind}" for n in fab.nics}
    out, prev = [], None
    for smp in mon.samples:
        busy = None
        if prev is not None and smp.cpu_total > prev.cpu_total:
            busy = round((smp.cpu_busy - prev.cpu_busy) / (smp.cpu_total - prev.cpu_total), 4)
        out.append({"t": round(smp.t - t0, 4), "cpu_busy": busy,
                    "nics": {names[d]: [tx, rx] for d, (rx, tx) in smp.bytes.items() if d in names}})
        prev = smp
    return out


def _router(cluster: Cluster, fab: Fabric, geom: BlockGeometry, mode: str, clock: "RunClock") -> ServiceRouter:
    """The scheduler service, pulled by the engine group leaders, with the mode's path policy."""
    kv_per_token = geom.kv_bytes_per_token
    # alpha is seconds of SNIC reads and beta seconds of prefill, both in the engines' time: on an
    # emulated clock the SNIC reads testbed bytes per testbed second, so alpha's 3 emulated seconds
    # last 3k here, while beta's tokens come from the target's own prefill rate.
    profile = Profile(snic_bytes_per_s=fab.topo.snic_bps / 8,
                      prefill_tokens_per_s=clock.prefill_tokens_per_s or cluster.prefill_tokens_per_s,
                      kv_bytes_per_token=kv_per_token, block_tokens=geom.block_size)
    sched = Scheduler(profile, path_policy=PATH_POLICY[mode], alpha_s=PAPER_ALPHA_S * clock.dilation,
                      beta_s=PAPER_BETA_S, stale_after_s=STALE_AFTER_S)
    return ServiceRouter(cluster, sched, CONDUCTOR_IP)


def parse_verify(text: str) -> int | None:
    """`--verify`: "all" (None) or "sample:N" (N trajectories); ValueError with the reason."""
    if text == "all":
        return None
    kind, _, n = text.partition(":")
    if kind != "sample" or not n.isdigit() or int(n) < 1:
        raise ValueError(f"--verify {text!r}: expected all or sample:N with N >= 1 trajectories")
    return int(n)


def verified_trajectories(trajectories: Iterable[int], sample: int | None, seed: int) -> set[int]:
    """The trajectories whose requests are checked: all, or `sample` of them drawn with `seed`
    (a whole trajectory or none: each turn's recomputation extends the turn before)."""
    ids = sorted(set(trajectories))
    if sample is None or sample >= len(ids):
        return set(ids)
    return set(random.Random(seed).sample(ids, sample))


def share_out(per_traj: dict[int, list[tuple]], workers: int) -> list[dict[int, list[tuple]]]:
    """Trajectories into `workers` groups of about equal requests (the longest first, each to the
    lightest group), each trajectory's requests as `check_trajectories` takes them."""
    groups: list[dict[int, list[tuple]]] = [{} for _ in range(workers)]
    load = [0] * workers
    for tid in sorted(per_traj, key=lambda t: (-len(per_traj[t]), t)):
        i = load.index(min(load))
        groups[i][tid] = [a for _, a in per_traj[tid]]
        load[i] += len(per_traj[tid])
    return [g for g in groups if g]


def verify(results: list[ModeResult], checkpoint: Path, geom: BlockGeometry,
           progress: Callable[[str], None], workers: int | None = None, device: str = "cpu",
           sample: int | None = None, seed: int = 0) -> None:
    """Every request's tokens and loaded KV against a full recomputation (oracle excepted);
    with `sample`, every request of that many trajectories drawn with `seed`, said in each
    mode's verdict.

    Trajectories are independent, so they are recomputed in `workers` processes (default: one
    per core this process may use; the engines are gone by now), each with its own reference;
    one trajectory's requests of every mode go to one process, in turn order, so that each turn
    extends the reference's own KV of the turn before and a request seen in an earlier mode is
    not computed again. Every process runs one thread: the same kernels, the same bits. The
    reference computes on the engines' `device`: a GPU's kernels give other bits than the CPU's.
    """
    import os

    from testbed.cluster.verify import check_trajectories

    per_traj: dict[int, list[tuple[tuple[int, int], tuple]]] = {}
    for mi, res in enumerate(results):
        if res.mode == "oracle":
            continue
        for ri, r in enumerate(res.records):
            if not r.error:
                per_traj.setdefault(r.trajectory, []).append(
                    ((mi, ri), (r.prompt, r.gen_len, r.tokens, r.n_hit, r.pe_layer_hashes, r.de_layer_hashes)))
    every = len(per_traj)
    keep = verified_trajectories(per_traj, sample, seed)
    per_traj = {t: v for t, v in per_traj.items() if t in keep}
    if workers is None and device == "cuda":
        workers = 1  # one GPU: more processes would only queue on it, each with its own context
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = max(1, min(workers, len(per_traj)))
    checked = [res.mode for res in results if res.mode != "oracle"]
    if checked:
        progress(f"  verifying {', '.join(checked)} against recomputation "
                 f"({sum(len(v) for v in per_traj.values())} requests"
                 + (f" of {len(per_traj)} of the {every} trajectories, a sample drawn with seed {seed}"
                    if len(per_traj) < every else "") + f", {workers} process{'es' * (workers > 1)})")
    verdicts: dict[tuple[int, int], Any] = {}
    groups = share_out(per_traj, workers)  # one batch of trajectories per process, in lockstep
    if workers == 1 or not groups:  # (none: only the oracle ran, which moves no KV to check)
        done = [check_trajectories(str(checkpoint), geom, g, device) for g in groups]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futs = [pool.submit(check_trajectories, str(checkpoint), geom, g, device) for g in groups]
            done = [f.result() for f in futs]
    for got in done:
        for tid, vs in got.items():
            verdicts.update(zip((k for k, _ in per_traj[tid]), vs))
    for mi, res in enumerate(results):
        if res.mode == "oracle":
            res.verdicts = {"tokens": "n/a (oracle moves no KV)"}
            continue
        res.verdicts = _tally(res, {ri: verdicts[(mi, ri)] for ri, r in enumerate(res.records)
                                    if not r.error and (mi, ri) in verdicts})
        if len(per_traj) < every:
            res.verdicts["sample"] = {"trajectories": len(per_traj), "of": every, "seed": seed}


def _tally(res: ModeResult, verdicts: dict[int, Any]) -> dict[str, Any]:
    """One mode's verification: counts per check, and the first request that failed one, with
    the check and (for KV) the first layer that differed."""
    n = tok = pe_ok = pe_n = de_ok = de_n = 0
    first: dict[str, Any] | None = None
    for ri, v in verdicts.items():
        r = res.records[ri]
        res.wrong_tokens[r.request] = v.wrong_tokens
        n += 1
        tok += v.tokens_match
        if v.pe_kv_match is not None:
            pe_n += 1
            pe_ok += v.pe_kv_match
        if v.de_kv_match is not None:
            de_n += 1
            de_ok += v.de_kv_match
        if first is None:  # the KV a request loaded explains its tokens, so it is named first
            failed = [(c, layer) for c, ok, layer in (("pe_kv_bit_exact", v.pe_kv_match, v.pe_bad_layer),
                                                      ("de_kv_bit_exact", v.de_kv_match, v.de_bad_layer),
                                                      ("tokens_match", v.tokens_match, None)) if ok is False]
            if failed:
                first = {"request": r.request, "check": failed[0][0], "layer": failed[0][1]}
    return {"requests": n, "tokens_match": tok, "pe_kv_bit_exact": f"{pe_ok}/{pe_n}",
            "de_kv_bit_exact": f"{de_ok}/{de_n}", "all_match": tok == n and pe_ok == pe_n and de_ok == de_n,
            "first_mismatch": first["request"] if first else None, "first_failed_check": first}


def fabric_transport(transport: str) -> str:
    """What the fabric must offer for a KV transport: rxe devices for rdma, plain TCP otherwise
    (Mooncake's transfer engine brings its own TCP transport)."""
    return "rdma" if transport in ("rdma", "mooncake-rdma") else "tcp"


def transport_label(in_use: Iterable[str]) -> str:
    """How the report names what the node processes said they use ("ucx/tcp via eth0", ...)."""
    kinds = sorted({t.split(" via ")[0] for t in in_use})
    return ", ".join(f"NIXL {k}" if k.startswith("ucx/") else k for k in kinds)


def run_e2e(fab: Fabric, workload: Workload, checkpoint: Path, run_dir: Path, modes: tuple[str, ...] = MODES,
            buffer_bytes: int = 256 << 20, hbm_bytes: int = 128 << 20, block_size: int = RUN_BLOCK_TOKENS,
            progress: Callable[[str], None] = print, transport: str = "tcp",
            quota_s: float = 0.3, faults: tuple[FaultSpec, ...] = (), seed: int = 0,
            device: str = "cpu", connector: ConnectorRef | None = None,
            verify_sample: int | None = None) -> list[ModeResult]:
    """Every mode on one cluster; with `faults`, every mode on a fresh cluster of its own (a
    fault kills processes and fills disks: the next mode must not inherit that), each mode
    getting every fault. The engines, and the recomputation that checks them, compute on
    `device`; they run `connector`, a team's plug-in, where it applies (dualpath/kv/plugin.py)."""
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; expected some of {MODES}")
    check_on_first_server(list(faults), fab.topo)
    geom = run_geometry(checkpoint, block_size)
    clock = RunClock.of(fab.topo, geom)
    results: list[ModeResult] = []
    tmpfs = {f.target: DISK_FULL_TMPFS_BYTES for f in faults if f.kind == "disk-full"}

    def cluster_for(folder: Path) -> Cluster:
        return Cluster.for_topology(fab, folder, checkpoint, geom, buffer_bytes=buffer_bytes, hbm_bytes=hbm_bytes,
                                    transport=transport, tmpfs_stores=tmpfs, device=device, connector=connector)

    def up(cluster: Cluster) -> None:
        t0 = time.monotonic()
        cluster.run(cluster.connect())
        progress(f"  cluster up in {time.monotonic() - t0:.1f}s: {len(cluster.procs)} node processes, "
                 f"{len(cluster.stores)} storage server(s); transport {sorted(set(cluster.transports.values()))[0].split(' via ')[0]}")

    def one(cluster: Cluster, mode: str) -> None:
        progress(f"  mode {mode}" + (f" with {len(faults)} fault(s)" if faults else ""))
        ns = f"{run_dir.name}/{mode}".encode()[:64]
        results.append(_run_mode(cluster, fab, geom, workload, mode, ns, progress, quota_s, clock, faults, seed))
        r = results[-1]
        progress(f"    {mode}: {'FAITHFUL' if r.faithful else 'UNFAITHFUL'}, JCT {clock.to_emulated(r.jct_s):.2f} s "
                 f"emulated ({r.jct_s:.1f} s here), CPU busy {r.cpu_busy:.0%}")
        r.transport = transport_label(cluster.transports.values())

    if not faults:
        with cluster_for(run_dir) as cluster:
            up(cluster)
            for mode in modes:
                one(cluster, mode)
    else:
        for mode in modes:
            with cluster_for(run_dir / mode) as cluster:
                up(cluster)
                one(cluster, mode)
    verify(results, checkpoint, geom, progress, device=device, sample=verify_sample, seed=seed)
    return results


def cluster_summary(topo: Topology) -> dict[str, Any]:
    """Where each node and storage server ran, and the kernels every server computed with."""
    from dualpath.model.numerics import PORTABLE_KERNELS, portable_kernels_set

    where = placement(topo)
    return {"servers": list(dict.fromkeys(where.values())), "placement": where,
            "kernels": {"portable": portable_kernels_set(), "env": PORTABLE_KERNELS}}


def run_to_folder(topo: Topology, workload: Workload, checkpoint: Path, run_dir: Path, command: str,
                  modes: tuple[str, ...], progress: Callable[[str], None] = print, transport: str = "tcp",
                  quota_s: float = 0.3, extra: dict[str, Any] | None = None,
                  faults: tuple[FaultSpec, ...] = (), device: str = "cpu",
                  connector: ConnectorRef | None = None, bring_up: Callable[..., Any] | None = None,
                  verify_sample: int | None = None) -> dict[str, Any]:
    """One `dualpath run`: bring the topology up (`bring_up(topo, transport, shares)`, a context
    manager giving the fabric: `dualpath run` passes a Testbed's; by default
    testbed.fabric.access.claimed_fabric), run every mode (each with `faults`, seeded by the
    workload's seed), tear down, and write
    run_dir/{summary.json, records.jsonl, passes.jsonl, steps.jsonl, links.jsonl, report.md}.
    Returns the summary. The scratch folder (logs, the store's disk) is removed only once the
    results are written, so a failed run keeps its logs."""
    import shutil

    from testbed.measure.report import e2e_lines

    scratch = Path("/var/tmp") / f"dpt-run-{run_dir.name}"
    geom = run_geometry(checkpoint)
    t0 = time.monotonic()
    spec = topo.spec
    shares = (scratch, checkpoint if checkpoint.is_dir() else checkpoint.parent,  # what nodes read and write
              *((connector.path,) if connector is not None and not connector.path.is_relative_to(REPO) else ()))
    # (a plug-in outside the repository: docker nodes, which see the repository, import it from there)
    with (bring_up or claimed_fabric)(topo, fabric_transport(transport), shares) as fab:  # the buffers' budgets come from the topology (memory is touched only as used)
        results = run_e2e(fab, workload, checkpoint, scratch, modes=modes, progress=progress, transport=transport,
                          quota_s=quota_s, buffer_bytes=int(spec.dram_buffer_gib * 2**30),
                          hbm_bytes=int(spec.hbm_gib_per_engine * 2**30), faults=faults,
                          seed=workload.config.seed, device=device, connector=connector,
                          verify_sample=verify_sample)
    summary = summarize(results, workload, geom, topo)
    if faults:
        summary["fault_injection"] = {
            "faults": [f.text for f in faults], "seed": workload.config.seed,
            "time": "T and every *_s of a fault are emulated seconds after the mode's first request "
                    f"(x {RunClock.of(topo, geom).dilation:.3g} on the testbed's clock)",
            "store_restart_after_s": RESTART_DELAY_S, "disk_full_for_s": DISK_FULL_S}
    summary.update({"topology": topo.name, "trajectories": len(workload.trajectories), "seed": workload.config.seed,
                    "checkpoint": shown_path(checkpoint), "wall_s": round(time.monotonic() - t0, 1), "quota_s": quota_s,
                    "first_turn_tokens": workload.config.first_append_len,
                    "transport": results[0].transport if results else transport, "device": device,
                    "hosts": spec.hosts, "fabric_s": {k: round(v, 2) for k, v in fab.timings.items()},
                    "workload": workload.config.to_dict(), "code": code_version(), **(extra or {})})
    if spans_servers(topo):
        summary["cluster"] = cluster_summary(topo)
    if workload.trace is not None:
        from dualpath.workload.trace import with_run_hits

        summary["trace"] = with_run_hits(workload.trace, {
            res.mode: (sum(r.n_hit for r in res.records if not r.error),
                       sum(r.n_prompt for r in res.records if not r.error)) for res in results})
    conv = conversation(results, checkpoint, workload)
    if conv:
        summary["conversation"] = conv
    if "rdma" in summary:
        from dualpath.transport.rdma import rxe_mtu

        summary["rdma"]["rdma_mtu"] = rxe_mtu(spec.mtu)
    write_results(results, summary, run_dir, command)
    (run_dir / "report.md").write_text(f"# dualpath run: {topo.name}\n\nProduced by `{command}`.\n\n```\n"
                                       + "\n".join(e2e_lines(summary)) + "\n```\n")
    shutil.rmtree(scratch, ignore_errors=True)
    if fabric_transport(transport) == "rdma":  # proof of transport, not configuration: the counters decide
        from dualpath.transport.env import RdmaNotProvenError
        from dualpath.transport.rdma import not_proven_message

        bad = [(m, r) for m, r in ((m, v.get("rdma")) for m, v in summary["modes"].items())
               if r is not None and not r["rdma_proven"]]
        if bad or "rdma" not in summary:
            raise RdmaNotProvenError(not_proven_message(bad[0][1], f"`dualpath run` (mode {bad[0][0]})")
                                     if bad else "`dualpath run` asked for RDMA, but no mode moved KV to prove it")
    return summary
