"""The isolation experiment: one cluster, one workload, three conditions (root, the testbed).

The paper argues for virtual-lane isolation of KV traffic from the model's collectives but never
shows QoS off against QoS on. Here, on a topology whose engines run the target's per-layer
AllToAll in the model class (`collectives: on`), the same workload runs three times on one live
cluster:
- idle: no KV traffic at all (every request in oracle mode: nothing is read or written);
- qos_on: the same, beside a saturating kv-class load into every engine's CNIC (testbed/experiments/kvload.py);
- qos_off: the same load, with every CNIC's HTB collapsed into one FIFO (`qos: off`).
The requests move no KV of their own, so the only difference between the conditions is the kv
load and the QoS; each condition's collectives, forward passes, TTFT and TPOT come from the run.

The run folder is a `dualpath run` folder whose "modes" are the three conditions (records,
passes, steps and links per condition), plus per condition the KV load's bytes from the kernel's
counters (`isolation` in summary.json). A loaded condition is FAITHFUL only if, besides the usual
rules, every flooded CNIC carried at least LOAD_MIN of its rate: otherwise the load was not
saturating and nothing was measured under it.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from dualpath.traffic_classes import KV, MODEL
from dualpath.workload import Workload
from testbed.fabric.access import claimed_fabric
from testbed.cluster.processes import Cluster
from testbed.experiments.ablation import _run_mode, run_geometry
from testbed.experiments.results import ModeResult, summarize, write_results
from testbed.fabric.network import Fabric
from testbed.experiments.kvload import KvLoad
from testbed.paths import code_version, shown_path
from testbed.cluster.runclock import RunClock
from testbed.topology import Topology

CONDITIONS = ("idle", "qos_on", "qos_off")
SETTLE_S = 2.0  # a load's flows reach the link rate (and fill the queue) before requests start
LOAD_MIN = 0.9  # a loaded CNIC must carry this share of its rate (wire) over the condition


def load_share(samples: list[dict], window: tuple[float, float], rates: dict[str, int]) -> dict[str, float]:
    """Per engine, the bytes its CNIC received over `window` (every class; the monitor's interface
    counters, interpolated at the window's edges), as a share of what its rate carries then.
    `samples` are ModeResult.samples ({t, nics: {"<ns>/cnic": [rx, tx]}}), `window` in their time."""
    import numpy as np

    t0, t1 = window
    ts = [s["t"] for s in samples]
    out = {}
    if t1 <= t0 or len(samples) < 2:
        return {e: 0.0 for e in rates}
    for eng, rate in rates.items():
        rx = [s["nics"].get(f"{eng}/cnic", [0, 0])[0] for s in samples]
        got = float(np.interp(t1, ts, rx) - np.interp(t0, ts, rx))
        out[eng] = round(got * 8 / (t1 - t0) / rate, 4)
    return out


def request_window(res: ModeResult) -> tuple[float, float]:
    """From the first request's arrival to the last one's end (the conductor's time, as samples)."""
    ok = [r for r in res.records if r.t_done]
    return (min(r.t_arrive for r in ok), max(r.t_done for r in ok)) if ok else (0.0, 0.0)


def class_bytes(dscp: dict[str, dict[str, tuple[int, int]]]) -> dict[str, int]:
    """Bytes every namespace sent in each DSCP class, added up (nftables)."""
    return {tc: sum(per.get(tc, (0, 0))[0] for per in dscp.values()) for tc in (MODEL.name, KV.name)}


def run_condition(cluster: Cluster, fab: Fabric, geom, workload: Workload, cond: str, run_name: str,
                  clock: RunClock, progress: Callable[[str], None], quota_s: float, cc: str
                  ) -> tuple[ModeResult, dict[str, Any]]:
    """One condition: the workload in oracle mode, with the kv load and QoS it names. Returns the
    mode's result (named after the condition, its verdict extended by the load's) and what the
    summary's `isolation` block of the condition says."""
    if cond not in CONDITIONS:
        raise ValueError(f"unknown condition {cond!r}; expected one of {CONDITIONS}")
    qos = cond != "qos_off"
    fab.apply_shaping(qos)  # recreates every qdisc: counters start from zero under it
    engines = [e for e in fab.endpoints if e.kind == "engine"]
    ns = f"{run_name}/{cond}".encode()[:64]
    if cond == "idle":
        res = _run_mode(cluster, fab, geom, workload, "oracle", ns, progress, quota_s, clock)
        loaded = {}
    else:
        with KvLoad(fab, engines, cc=cc) as load:
            time.sleep(SETTLE_S)
            res = _run_mode(cluster, fab, geom, workload, "oracle", ns, progress, quota_s, clock)
            stopped = [e.name for e in engines if e.name not in load.alive()]
        rates = {e.name: e.nic("cnic").rate_bps for e in engines}
        loaded = load_share(res.samples, request_window(res), rates)
        if stopped:
            res.unfaithful_reasons.append(f"the kv load into {', '.join(stopped)} ended before the condition did")
        thin = {e: s for e, s in loaded.items() if s < LOAD_MIN}
        if thin:
            res.unfaithful_reasons.append(
                "the kv load did not saturate " + ", ".join(f"{e} ({s:.0%} of its rate)" for e, s in sorted(thin.items()))
                + f" (need {LOAD_MIN:.0%})")
        res.faithful = not res.unfaithful_reasons
    res.mode = cond
    for r in res.records:
        r.mode = cond
    # oracle requests compute over a past of zeros: there is nothing to check against a recomputation
    res.verdicts = {"tokens": "n/a (oracle: the requests move no KV)"}
    sent = class_bytes(res.dscp)
    info = {"qos": qos, "kv_load": cond != "idle", "cnic_rx_share_of_rate": loaded,
            "class_bytes": sent, "counters_window_testbed_s": round(res.counters_s, 3),
            # the kv class's bytes per testbed second over the counters' window: the load's throughput
            "kv_bytes_per_s": round(sent[KV.name] / res.counters_s, 1) if res.counters_s else None,
            "request_window_testbed_s": list(request_window(res))}
    return res, info


def run_isolation(topo: Topology, workload: Workload, checkpoint: Path, run_dir: Path, command: str,
                  progress: Callable[[str], None] = print, quota_s: float = 0.3, cc: str = "cubic",
                  conditions: tuple[str, ...] = CONDITIONS, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Bring the topology up once, run every condition, tear down; write the run folder like
    `dualpath run` does (summary.json's modes are the conditions). Returns the summary."""
    if not topo.spec.collectives:
        raise ValueError(f"topology {topo.name} runs no collectives (collectives: off): nothing to isolate")
    scratch = Path("/var/tmp") / f"dpt-run-{run_dir.name}"
    geom = run_geometry(checkpoint)
    clock = RunClock.of(topo, geom)
    spec = topo.spec
    t0 = time.monotonic()
    results: list[ModeResult] = []
    info: dict[str, dict] = {}
    with claimed_fabric(topo) as fab:
        with Cluster.for_topology(fab, scratch, checkpoint, geom) as cluster:
            cluster.run(cluster.connect())
            progress(f"  cluster up in {time.monotonic() - t0:.1f}s: {len(cluster.procs)} node processes")
            for cond in conditions:
                progress(f"  condition {cond}")
                res, info[cond] = run_condition(cluster, fab, geom, workload, cond, run_dir.name, clock, progress,
                                                quota_s, cc)
                results.append(res)
                progress(f"    {cond}: {'FAITHFUL' if res.faithful else 'UNFAITHFUL'}, {res.jct_s:.1f} s here, "
                         f"CPU busy {res.cpu_busy:.0%}")
            fab.apply_shaping(spec.qos)
    summary = summarize(results, workload, geom, topo)
    for cond, block in info.items():
        summary["modes"][cond]["isolation"] = block
    summary.update({"topology": topo.name, "trajectories": len(workload.trajectories), "seed": workload.config.seed,
                    "checkpoint": shown_path(checkpoint), "wall_s": round(time.monotonic() - t0, 1), "quota_s": quota_s,
                    "first_turn_tokens": workload.config.first_append_len, "workload": workload.config.to_dict(),
                    "code": code_version(), "experiment": "isolation",
                    "kv_load": {"cc": cc, "flows": "one per engine, host port -> CNIC",
                                "settle_s": SETTLE_S, "saturated_min": LOAD_MIN},
                    **(extra or {})})
    write_results(results, summary, run_dir, command)
    shutil.rmtree(scratch, ignore_errors=True)
    return summary
