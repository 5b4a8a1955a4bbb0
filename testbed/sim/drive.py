"""`dualpath sim`: the simulator (simulator) on a topology, with a testbed run's summary.

`sim_config` turns a topology into the simulator's cluster the way the testbed builds its own:
the links' payload rates (the wire rate HTB shapes times the TCP payload share at the topology's
MTU, testbed.measure.fidelity.payload_share), the target's cost models and prefill rate, the scheduler's
profile, alpha and beta exactly as testbed.experiments.ablation._router passes them, the compute quota,
every engine's HBM in tokens and every node's DRAM buffer. Two time bases:

  * units="testbed": the testbed's KV bytes per token (its model's) and the topology's scaled
    rates; time is testbed seconds and emulated seconds are those over the dilation, as in a
    testbed run. This is what validation compares.
  * units="target": the target model's KV bytes per token and layers and the paper's rates
    (scale 1); the dilation is 1 and time is the target cluster's. This is what projects the
    paper's 1,152-GPU runs (topologies/sim/).

`simulate` runs modes over a workload and `summarize` writes the summary.json fields of a
`dualpath run` (testbed.experiments.results.summarize), from the same arithmetic (testbed.measure.metrics), so one
report and one plot code read both.

A trace (dualpath.workload.trace.TraceWorkload) replaces the generated workload: its sessions are
agents whose turns carry their own prompts' block keys (`trace_turns`), so hits come from one store
shared by every agent, as on the testbed; the summary's `trace` object says how the run's hit rate
compares with the one the trace's prefixes allow.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from dualpath.scheduler.thresholds import PAPER_ALPHA_S, PAPER_BETA_S, Profile
from dualpath.workload import WorkloadConfig, demo_workload, generate_lengths, poisson_arrivals
from dualpath.workload.trace import TraceWorkload, block_keys, with_run_hits
from emulators.nic import burst_bytes
from simulator.calibration import UNCALIBRATED, Calibration
from simulator.agents import TraceTurn, TrajectorySpec
from simulator.cluster import ClusterSim, SimConfig, SimResult
from testbed.measure.fidelity import payload_share
from testbed.measure.metrics import forward_balance, percentiles, speedups, token_latencies
from testbed.cluster.modes import PATH_POLICY, connector_of
from testbed.paths import REPO
from testbed.topology import Topology

RUN_BLOCK_TOKENS = 32  # = testbed.experiments.ablation.RUN_BLOCK_TOKENS (not imported: that pulls in the cluster)
DEMO_KV_BYTES_PER_TOKEN = 2048  # = dualpath.model.tiny.DEMO_KV_BYTES_PER_TOKEN, the demo checkpoint's
DEMO_LAYERS = 8  # the demo checkpoint's layers (dualpath.model.tiny.DEMO)
DEFAULT_QUOTA_S = 0.3
UNITS = ("testbed", "target")


@dataclass(frozen=True)
class Geometry:
    """The simulated KV: bytes per token over all layers, layers, tokens per Full Block."""

    kv_bytes_per_token: int = DEMO_KV_BYTES_PER_TOKEN
    n_layer: int = DEMO_LAYERS
    block_size: int = RUN_BLOCK_TOKENS


def sim_config(topo: Topology, geom: Geometry = Geometry(), units: str = "testbed",
               cal: Calibration = UNCALIBRATED, quota_s: float = DEFAULT_QUOTA_S, pe_groups: str = "one") -> SimConfig:
    if units not in UNITS:
        raise ValueError(f"units must be one of {UNITS}, got {units!r}")
    s = topo.spec
    tgt = topo.target()
    if units == "target":  # the target's own KV and the paper's rates: no dilation
        geom = Geometry(tgt.model.kv_bytes_per_token, tgt.model.n_layers, geom.block_size)
        rate = lambda bps: bps / s.scale  # noqa: E731  (topology rates are scaled; undo it)
        dilation = 1.0
    else:
        rate = lambda bps: float(bps)  # noqa: E731
        dilation = topo.dilation(geom.kv_bytes_per_token)
    pay = payload_share(s.mtu)
    eff = cal.compute_efficiency
    snic = rate(topo.snic_bps)
    profile = Profile(snic_bytes_per_s=snic / 8, prefill_tokens_per_s=tgt.prefill_tokens_per_s(0),
                      kv_bytes_per_token=geom.kv_bytes_per_token, block_tokens=geom.block_size)
    gib = 2 ** 30
    hbm = topo.hbm_plan(geom.kv_bytes_per_token if units == "testbed" else None)
    return SimConfig(
        prefill_nodes=s.prefill_nodes, decode_nodes=s.decode_nodes, engines_per_node=s.engines_per_node,
        cnic_bps=rate(topo.cnic_bps) * pay * eff, snic_bps=snic * pay, host_port_bps=rate(topo.host_port_bps) * pay * eff,
        storage_servers=s.storage.servers, storage_nic_bps=rate(topo.storage_nic_bps) * pay, disk_bps=rate(topo.disk_bps),
        qos=s.qos, kv_bytes_per_token=geom.kv_bytes_per_token, n_layer=geom.n_layer, block_size=geom.block_size,
        dilation=dilation, prefill_cost=tgt.prefill_cost(), decode_cost=tgt.decode_cost(), profile=profile,
        alpha_s=PAPER_ALPHA_S * dilation, beta_s=PAPER_BETA_S, quota_s=quota_s,
        hbm_tokens=hbm.decode.tokens, hbm=hbm,
        buffer_bytes=int(s.dram_buffer_gib * gib), calibration=cal, pe_groups=pe_groups,
        buckets=_htb_buckets(topo) if units == "testbed" else {})


def _htb_buckets(topo: Topology) -> dict[str, float]:
    """The payload bytes of each shaped NIC kind's HTB bucket, as emulators/nic.py sets them."""
    mtu = topo.spec.mtu
    pay = payload_share(mtu)
    return {kind: burst_bytes(int(bps), mtu) * pay for kind, bps in
            (("snic", topo.snic_bps), ("cnic", topo.cnic_bps), ("host_port", topo.host_port_bps),
             ("storage_nic", topo.storage_nic_bps))}


def trajectories(wcfg: WorkloadConfig, dilation: float, aps: float | None = None,
                 arrival_seed: int = 0) -> list[TrajectorySpec]:
    """The workload's agents by their lengths (dualpath.workload.generate_lengths: the same
    lengths the testbed's generator gives). Offline every agent starts at 0; online they arrive
    as the testbed's Poisson process (poisson_arrivals, agents per emulated second)."""
    lengths = generate_lengths(wcfg)
    arr = poisson_arrivals(len(lengths), aps, arrival_seed) if aps else [0.0] * len(lengths)
    return [TrajectorySpec(i, wcfg.system_prompt_len, turns, a * dilation)
            for i, (turns, a) in enumerate(zip(lengths, arr))]


def trace_trajectories(tw: TraceWorkload, cfg: SimConfig) -> list[TrajectorySpec]:
    """The trace's sessions as agents: each turn its request's own prompt (its Full Blocks' keys)
    and generation, arrivals and turn times in simulation seconds (emulated times the dilation)."""
    bs = cfg.block_size
    out = []
    for sid, (s, (arrive, ats)) in enumerate(zip(tw.sessions, tw.arrivals(cfg.dilation))):
        reqs = [tw.requests[i] for i in s]
        turns = [TraceTurn(r.input_length, tw.gen_len(r), block_keys(r, bs), at) for r, at in zip(reqs, ats)]
        out.append(TrajectorySpec(sid, 0, [(t.prompt_len, t.gen_len) for t in turns], arrive, trace_turns=turns))
    return out


def check_trace_fits(trajs: Sequence[TrajectorySpec], cfg: SimConfig, moves_kv: bool = True) -> None:
    """Refuse, in one line, trace turns no engine or buffer of the cluster could ever take: the
    scheduler admits a prompt only into a decode engine's free HBM, and a request holds its DE
    area and its write-back in one node's DRAM buffer at once; one that never fits never runs,
    and the simulation would wait for it for ever (its leaders' heartbeats go on)."""
    bs = cfg.block_size
    turns = [t for tr in trajs for t in (tr.trace_turns or ())]

    def least_held(p: int, g: int) -> int:  # on its DE node: the prompt's area, the write-back past every hit
        return (cfg.blocks_spanned(p) + (p + g - 1) // bs - (p - 1) // bs) * cfg.full_block_bytes

    hbm = sum(t.prompt_len > cfg.hbm_tokens for t in turns)
    buf = sum(t.prompt_len <= cfg.hbm_tokens and least_held(t.prompt_len, t.gen_len) > cfg.buffer_bytes
              for t in turns) if moves_kv else 0
    if hbm or buf:
        raise ValueError(
            f"{hbm + buf} of the trace's {len(turns)} requests can never run on this cluster: {hbm} prompts longer "
            f"than a decode engine's HBM ({cfg.hbm_tokens} tokens at {cfg.kv_bytes_per_token} B/token), {buf} "
            f"whose KV outgrows a node's {cfg.buffer_bytes / 2 ** 30:g} GiB DRAM buffer (longest prompt "
            f"{max(t.prompt_len for t in turns)} tokens); raise the length scale or choose a larger topology")


def simulate(cfg: SimConfig, trajs: Sequence[TrajectorySpec] | None, modes: Sequence[str],
             progress: Callable[[str], None] = lambda s: None,
             trace: TraceWorkload | None = None) -> dict[str, SimResult]:
    """Each mode over the agents. With `trace`, every mode starts from the store its warm-up
    persists (TraceWorkload.warm_keys), and `trajs` may be None: the trace's own agents."""
    if trace is not None and trajs is None:
        trajs = trace_trajectories(trace, cfg)
    if trajs is None:
        raise ValueError("simulate: give the agents (trajs) or a trace")
    warm = trace.warm_keys(cfg.block_size) if trace is not None else ()
    for m in modes:
        if m not in PATH_POLICY:
            raise ValueError(f"unknown mode {m!r}; expected some of {', '.join(PATH_POLICY)}")
    check_trace_fits(trajs, cfg, moves_kv=any(connector_of(m) != "oracle" for m in modes))
    out = {}
    for m in modes:
        sim = ClusterSim(cfg, m, connector_of(m), PATH_POLICY[m], trajs, warm_keys=warm)
        out[m] = r = sim.run()
        rate = f", {len(r.records) / r.wall_s:.0f} requests/s" if r.wall_s > 0 else ""
        progress(f"  {m}: JCT {r.jct_s / cfg.dilation:.4g} s emulated, {len(r.records)} requests, "
                 f"{r.wall_s:.1f} s to simulate{rate}")
    return out


def trace_summary(tw: TraceWorkload, results: dict[str, SimResult]) -> dict[str, Any]:
    """The summary's `trace` object (dualpath.workload.trace.with_run_hits), as a testbed run's."""
    ok = {m: [r for r in res.records if not r.error] for m, res in results.items()}
    return with_run_hits(tw.stats(), {m: (sum(r.n_hit for r in recs), sum(r.n_prompt for r in recs))
                                      for m, recs in ok.items()})


def _latencies(recs) -> list[dict]:
    return [token_latencies(r.t_arrive, r.token_times) for r in recs if r.token_times]


def mode_summary(res: SimResult, cfg: SimConfig, p: int, d: int) -> dict[str, Any]:
    """One mode's summary.json entry, with testbed.experiments.results.summarize's keys."""
    k = cfg.dilation
    recs = [r for r in res.records if not r.error]
    lat = _latencies(recs)
    hit = sum(r.n_hit for r in recs)
    prompt = sum(r.n_prompt for r in recs)
    snic_rx = [v for name, v in res.link_bytes.items() if name.endswith("/snic/rx")]
    nodes = [f"{cfg.node_prefix}p{i}" for i in range(p)] + [f"{cfg.node_prefix}d{i}" for i in range(d)]
    per_node = {n: res.link_bytes.get(f"{n}/snic/rx", 0.0) for n in nodes}
    snic = list(per_node.values())
    pe_att: dict[str, float] = {}
    for r in recs:
        pe_att[r.pe] = pe_att.get(r.pe, 0.0) + r.attention_s
    ajct = res.agent_jct_s
    sched = res.scheduler
    sim_emulated_s = res.jct_s / k if k else 0.0
    return {
        "faithful": True, "unfaithful_reasons": [], "simulated": True,
        "requests": len(res.records), "errors": len(res.records) - len(recs),
        "jct_s": round(res.jct_s / k, 4), "jct_testbed_s": round(res.jct_s, 3),
        "agent_jct_s": {"mean": round(sum(ajct) / len(ajct) / k, 4) if ajct else None,
                        **percentiles(ajct, scale=1 / k)},
        "ttft_s": percentiles((x["ttft"] for x in lat), scale=1 / k),
        "ttst_s": percentiles((x["ttst"] for x in lat), scale=1 / k),
        "tpot_s": percentiles((x["tpot"] for x in lat), scale=1 / k),
        "hit_rate": round(hit / prompt, 4) if prompt else 0,
        "paths": {q: sum(r.path == q for r in recs) for q in ("pe", "de", "split", "none")},
        "snic_max_over_avg": round(max(snic) / (sum(snic) / len(snic)), 3) if sum(snic_rx) else None,
        "snic_rx_bytes": {n: int(v) for n, v in per_node.items()},
        "attention_max_over_avg": (round(max(pe_att.values()) / (sum(pe_att.values()) / len(pe_att)), 3)
                                   if pe_att and sum(pe_att.values()) else None),
        "forward_attention_max_over_avg": forward_balance(res.passes),
        "forward_attention_all_steps": forward_balance(res.passes, loaded_only=False),
        "forward_batches": len(res.passes),
        "chunked_requests": sum(r.passes > 1 for r in recs),
        "mean_batch_size": round(sum(b["n"] for b in res.passes) / len(res.passes), 2) if res.passes else None,
        "reread_bytes": 0,
        "scheduler": {
            "decision_s": round(sched["decision_s"], 4), "calls": sched["calls"],
            "us_per_request": round(sched["us_per_request"], 2),
            # the scheduler's CPU per second of the simulated cluster: cores it needs to keep up
            "cores_at_cluster_speed": round(sched["decision_s"] / sim_emulated_s, 5) if sim_emulated_s else None},
        "decode": {"segments": res.decode_segments, "steps": res.decode_steps,
                   "mean_batch": round(res.decode_step_tokens / res.decode_steps, 2) if res.decode_steps else None},
        "simulation": {"wall_s": round(res.wall_s, 2), "network_events": res.events, "seed": cfg.seed,
                       "requests_per_wall_s": round(len(res.records) / res.wall_s, 1) if res.wall_s > 0 else None,
                       "latency_jitter": cfg.calibration.jitter, **res.network},
    }


def summarize(results: dict[str, SimResult], cfg: SimConfig, topo: Topology, wcfg: WorkloadConfig,
              units: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    s = topo.spec
    tgt = f"{s.target.model} on {s.target.gpu}"
    out: dict[str, Any] = {
        # a simulation has no emulation that could slip: its time is FAITHFUL to its own model
        "faithful": True, "simulated": True, "target": tgt, "dilation": round(cfg.dilation, 6),
        "time": {"compute": "simulated", "units": units, "target": tgt, "dilation": round(cfg.dilation, 6),
                 "kv_bytes_per_token": {"simulated": cfg.kv_bytes_per_token}},
        "topology": topo.name, "trajectories": wcfg.n_trajectories, "seed": wcfg.seed,
        "first_turn_tokens": wcfg.first_append_len, "quota_s": cfg.quota_s, "workload": wcfg.to_dict(),
        "calibration": cfg.calibration.to_dict(), "modes": {}}
    for m, res in results.items():
        out["modes"][m] = mode_summary(res, cfg, s.prefill_nodes, s.decode_nodes)
    speedups(out["modes"], s.prefill_nodes, s.decode_nodes)
    out.update(extra or {})
    return out


def write_results(run_dir: Path, summary: dict[str, Any], results: dict[str, SimResult], command: str,
                  records: bool = True) -> None:
    """summary.json (with the command), records.jsonl and passes.jsonl in a run folder's layout
    (testbed seconds of the simulated cluster), and a short report."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps({"command": command, **summary}, indent=2) + "\n")
    k = summary.get("dilation", 1.0)
    if records:
        with open(run_dir / "records.jsonl", "w") as f:
            for res in results.values():
                for r in res.records:
                    d = r.to_json()
                    lat = token_latencies(r.t_arrive, r.token_times) if r.token_times else {}
                    d.update({f"{n}_s": (round(v / k, 6) if v is not None else None) for n, v in lat.items()})
                    f.write(json.dumps(d) + "\n")
        with open(run_dir / "passes.jsonl", "w") as f:
            for m, res in results.items():
                for b in res.passes:
                    f.write(json.dumps({"mode": m, **b}) + "\n")
    lines = [f"# dualpath sim: {summary.get('topology')}", "", f"Produced by `{command}`.", "",
             f"Simulated ({summary['time']['units']} units, dilation {k:g}); calibration: "
             f"{summary['calibration'].get('source', {}).get('run', 'none')}.", "",
             "| mode | JCT (emulated s) | TTFT p50 | TPOT p50 | SNIC max/avg | simulated in |",
             "| --- | --- | --- | --- | --- | --- |"]
    for m, v in summary["modes"].items():
        lines.append(f"| {m} | {v['jct_s']:.4g} | {_f(v['ttft_s']['p50'])} | {_f(v['tpot_s']['p50'])} | "
                     f"{_f(v['snic_max_over_avg'])} | {v['simulation']['wall_s']} s |")
    (run_dir / "report.md").write_text("\n".join(lines) + "\n")


MAX_RECORDS = 50_000  # more requests than this: summary and passes only (records.jsonl would be GBs)


def run_sim_to_folder(topo: Topology, wcfg: WorkloadConfig | None, modes: Sequence[str], run_dir: Path,
                      command: str, units: str = "testbed", cal: Calibration = UNCALIBRATED,
                      quota_s: float = DEFAULT_QUOTA_S, aps: float | None = None, seed: int = 0,
                      pe_groups: str = "one", progress: Callable[[str], None] = lambda s: None,
                      trace: TraceWorkload | None = None) -> dict[str, Any]:
    """`dualpath sim`: simulate the modes on the topology and write the run folder; the summary.
    With `trace`, its agents, arrivals and warm-up replace the generated workload's (wcfg is then
    ignored: the summary records trace.config()) and the summary gains a `trace` object."""
    if trace is not None and aps:
        raise ValueError("a trace brings its own arrivals (its timestamps, or none offline); drop --aps")
    if units == "target":
        cal = cal.without_host()  # a projected cluster has no testbed host whose CPU fills
    cfg = sim_config(topo, units=units, cal=cal, quota_s=quota_s, pe_groups=pe_groups)
    if trace is not None:
        wcfg = trace.config()
        trajs = trace_trajectories(trace, cfg)
        how = f", {trace.spec.describe()}"
    else:
        trajs = trajectories(wcfg, cfg.dilation, aps=aps, arrival_seed=seed)
        how = f", {aps:g} agents per second" if aps else ", offline"
    progress(f"simulating {topo.name} ({units} units, dilation {cfg.dilation:g}): {len(trajs)} agents, "
             f"{sum(t.n_requests for t in trajs)} requests{how}")
    t = time.perf_counter()
    results = simulate(cfg, trajs, modes, progress, trace=trace)
    extra: dict[str, Any] = {"wall_s": round(time.perf_counter() - t, 2)}
    if aps:
        extra["arrivals"] = {"aps": aps, "seed": seed, "agents": len(trajs), "unit": "agents per emulated second"}
    if trace is not None:
        extra["trace"] = tr = trace_summary(trace, results)
        progress(f"  hit rate {tr['run_hit_rate']:.4f} over every mode's requests "
                 f"(the trace's prefixes allow {tr['trace_block_hit_rate']:.4f})")
    summary = summarize(results, cfg, topo, wcfg, units, extra)
    n_req = sum(len(r.records) for r in results.values())
    write_results(run_dir, summary, results, command, records=n_req <= MAX_RECORDS)
    return {"command": command, **summary}


def _f(v) -> str:
    return "-" if v is None else f"{v:.4g}"


def trace_of_run(summary: dict[str, Any], block_size: int = RUN_BLOCK_TOKENS) -> TraceWorkload | None:
    """The trace a testbed run replayed (its summary's `trace.spec`), read again; None for a run
    of a generated workload. A trace named relative to the repository is read from this checkout."""
    spec = (summary.get("trace") or {}).get("spec")
    if not spec:
        return None
    from dualpath.workload.trace import TraceSpec, load_trace

    spec = {**spec, "window": tuple(spec["window"]) if spec.get("window") else None}
    path = Path(spec["path"])
    if not path.is_absolute() and not path.exists():
        path = REPO / path
    return load_trace(TraceSpec(**{**spec, "path": str(path)}), block_size)


def workload_of_run(summary: dict[str, Any]) -> WorkloadConfig:
    """The WorkloadConfig a testbed run's summary.json recorded; a run from before summaries
    carried it ran the demo workload (`dualpath run`'s), sized by its trajectories and seed."""
    if "workload" not in summary:
        return demo_workload(seed=int(summary.get("seed", 0)), n_trajectories=int(summary["trajectories"]),
                             first_append_len=int(summary.get("first_turn_tokens") or 0))
    w = dict(summary["workload"])
    w["notes"] = tuple(w.get("notes", ()))
    return WorkloadConfig(**w)
