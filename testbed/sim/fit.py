"""Fitting the simulator's calibration on testbed runs (see testbed/sim/validate.py for the steps), and the per-run helpers both fitting and validation use: a run's topology, geometry, stages and name."""
from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from simulator.calibration import Calibration
from testbed.topology import TOPOLOGIES, topology_with
from testbed.measure.runs import Run
from testbed.sim.drive import Geometry, sim_config, simulate, summarize, trace_of_run, trajectories, workload_of_run
from testbed.topology import Topology


STAGES = ("route", "read", "prefill", "handover", "tpot", "writeback")


LATENCIES = ("rpc_s", "pass_fixed_s", "xfer_latency_s", "step_gap_s", "flush_fixed_s", "read_contention_s",
             "load_fixed_s")


INITIAL = {"rpc_s": 2e-3, "pass_fixed_s": 2e-3, "xfer_latency_s": 3e-4, "step_gap_s": 5e-4, "flush_fixed_s": 3e-3,
           "read_contention_s": 1e-2, "load_fixed_s": 1e-3}


def _get(r, k):
    return r[k] if isinstance(r, dict) else getattr(r, k)


def stage_samples(records: Sequence) -> dict[str, list[float]]:
    """Seconds per stage of each of a mode's requests (testbed records or simulated ones alike)."""
    acc: dict[str, list[float]] = {k: [] for k in STAGES}
    for r in records:
        if _get(r, "error"):
            continue
        tt = _get(r, "token_times")
        start = _get(r, "t_read_start") or _get(r, "t_prefill_start")
        read_end = _get(r, "t_read_end") if _get(r, "t_read_start") else _get(r, "t_prefill_start")
        acc["route"].append(start - _get(r, "t_arrive"))
        if _get(r, "t_read_start"):
            acc["read"].append(read_end - start)
        acc["prefill"].append(_get(r, "t_first_token") - read_end)
        if len(tt) > 1:
            acc["handover"].append(tt[1] - tt[0])
        if len(tt) > 2:
            acc["tpot"].append((tt[-1] - tt[1]) / (len(tt) - 2))
        if tt:
            acc["writeback"].append(_get(r, "t_done") - tt[-1])
    return acc


def stages(records: Sequence) -> dict[str, float | None]:
    """Mean seconds per stage of a mode's requests."""
    return {k: (statistics.fmean(v) if v else None) for k, v in stage_samples(records).items()}


def dispersion(values: Sequence[float]) -> float | None:
    """How much `values` vary, robustly: the interquartile range over 1.349 (a normal law's
    standard deviation) relative to the median; None with fewer than 8 values or a zero median."""
    if len(values) < 8:
        return None
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / 1.349 / q[1] if q[1] > 0 else None


def run_topology(run: Run) -> Topology:
    """The run's topology, read as the file is now (topologies/<name>.yaml; a `dualpath reproduce`
    run's with the overrides its plan.json names). A run made when the file had other rates (its
    dilation differs) is refused: simulating it would compare the run with a cluster it never ran on."""
    cfg = (run.plan or {}).get("config") or {}
    name, overrides = cfg.get("topology") or run.topology, dict(cfg.get("topology_overrides") or {})
    path = TOPOLOGIES / f"{name}.yaml"
    if not path.exists():
        raise ValueError(f"{run.path}: topology {name!r} has no file {path}")
    topo = topology_with(name, overrides)
    ran = run.summary.get("dilation")
    now = topo.dilation(run_geometry(run).kv_bytes_per_token)
    if ran is not None and abs(float(ran) - now) > 1e-3 * now:
        raise ValueError(f"{run.path}: it ran {run.topology} at dilation {float(ran):g}, but {path.name}"
                         f"{f' with {overrides}' if overrides else ''} now gives {now:g} (its scale or rates "
                         f"changed); fix: run it again")
    return topo


def run_geometry(run: Run) -> Geometry:
    t = run.summary.get("time", {}).get("kv_bytes_per_token", {})
    kvb = int(t.get("testbed") or Geometry().kv_bytes_per_token)
    layers = Geometry().n_layer
    for m in run.modes:
        recs = run.records(m)
        if recs and recs[0].get("pe_layer_hashes"):
            layers = len(recs[0]["pe_layer_hashes"])
            break
    return Geometry(kvb, layers)


def digest(run: Run) -> str:
    return hashlib.sha256((run.path / "summary.json").read_bytes()).hexdigest()[:16]


def config_name(run: Run) -> str:
    """A `dualpath run` run's topology; a `dualpath reproduce` run's topology file and its folder's
    name (its workload: the topology's derived name says only which overrides it had)."""
    cfg = (run.plan or {}).get("config")
    return f"{cfg.get('topology')} {run.path.name}" if cfg else run.topology


def arrival_seed(run: Run) -> int:
    """The seed of an online run's Poisson arrivals (its workload seed unless it names one)."""
    return int((run.summary.get("arrivals") or {}).get("seed", run.summary.get("seed", 0)))


def _nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0, by enumerating the active sets (few columns)."""
    from itertools import combinations

    n = X.shape[1]
    scale = np.abs(X).max(axis=0)
    scale[scale == 0] = 1.0
    Xs = X / scale
    best, best_sse = np.zeros(n), float(y @ y)
    for k in range(1, n + 1):
        for cols in combinations(range(n), k):
            c, *_ = np.linalg.lstsq(Xs[:, cols], y, rcond=None)
            if np.any(c < 0):
                continue
            r = y - Xs[:, cols] @ c
            if float(r @ r) < best_sse:
                best_sse, best = float(r @ r), np.zeros(n)
                best[list(cols)] = c
    return best / scale


def fit_host(runs: Sequence[Run], cores: float) -> dict[str, Any]:
    """The engines' compute models and the host CPU's coefficients (step 1), over every run's modes."""
    P = [p for run in runs for m in run.modes for p in run.passes(m)]
    S = [s for run in runs for m in run.modes for s in run.steps(m)]
    if not P or not S:
        raise ValueError(f"{', '.join(str(r.path) for r in runs)}: needs passes.jsonl and steps.jsonl to fit the "
                         "host's CPU")
    pc = _nnls(np.array([[1.0, p["n"], p["predicted_s"]] for p in P]), np.array([p["timing"]["compute_wall_s"] for p in P]))
    sc = _nnls(np.array([[1.0, s["n"], s["emulated_s"]] for s in S]), np.array([s["compute_wall_s"] for s in S]))
    rows, y = [], []
    for run in runs:
        for m in run.modes:
            v = run.mode(m)
            T = v["jct_testbed_s"]
            eng = (sum(p["timing"]["compute_wall_s"] for p in run.passes(m))
                   + sum(s["compute_wall_s"] for s in run.steps(m))) / T
            mb = sum(r["measured"] for r in v["kv_bytes_vs_expected"]["per_direction"]) / T / 1e6
            rows.append([1.0, eng, mb])
            y.append(v["cpu_busy"] * cores)
    hc = _nnls(np.array(rows), np.array(y))
    pred = np.array(rows) @ hc
    return {"cpu_cores": float(cores), "cpu_base": float(hc[0]), "cpu_per_compute": float(hc[1]),
            "cpu_per_mbps": float(hc[2]), "pass_cpu": tuple(float(x) for x in pc),
            "step_cpu": tuple(float(x) for x in sc),
            "_fit": {"cpu_busy_residual_cores": [round(float(a - b), 4) for a, b in zip(pred, y)]}}


def exposed_io(run: Run) -> tuple[bool, dict[str, float]]:
    """Step 2: do the engines' transfers add to the windows? Compare the mean time a pass takes
    beyond its windows in basic (reads before the first layer) and layerwise (overlapped, if the
    transport moves bytes while the engine computes)."""
    def over(m):
        ps = run.passes(m)
        return statistics.fmean(p["t_end"] - p["t_start"] - p["timing"]["held_s"] for p in ps) if ps else None
    b, lw = over("basic"), over("layerwise")
    if b is None or lw is None or b <= 0:
        return False, {}
    return lw >= 0.8 * b, {"basic_pass_beyond_windows_s": round(b, 5), "layerwise_pass_beyond_windows_s": round(lw, 5)}


def _targets(run: Run, modes: Sequence[str]) -> dict[str, dict[str, float | None]]:
    out = {}
    for m in modes:
        st = stages(run.records(m))
        v = run.mode(m)
        st["jct"] = v["jct_testbed_s"]
        st["ttft_p50"] = v["ttft_s"]["p50"] * run.dilation
        out[m] = st
    return out


WEIGHTS = {"route": 1.0, "read": 1.0, "prefill": 1.0, "handover": 1.0, "tpot": 1.0, "writeback": 0.5, "jct": 3.0, "ttft_p50": 2.0}


def _run_sim(run: Run, cal: Calibration, seed: int = 0, modes: Sequence[str] | None = None,
             topo: Topology | None = None):
    """`run`'s configuration in the simulator: (its results per mode, the SimConfig, the topology,
    the workload)."""
    topo = topo or run_topology(run)
    cfg = replace(sim_config(topo, run_geometry(run), cal=cal, quota_s=float(run.summary.get("quota_s", 0.3))),
                  seed=seed)
    tw = trace_of_run(run.summary, cfg.block_size)
    if tw is not None:  # a replayed trace: its own agents, arrivals and warm-up
        return simulate(cfg, None, list(modes or run.modes), trace=tw), cfg, topo, tw.config()
    wcfg = workload_of_run(run.summary)
    trajs = trajectories(wcfg, cfg.dilation, aps=run.aps, arrival_seed=arrival_seed(run))
    return simulate(cfg, trajs, list(modes or run.modes)), cfg, topo, wcfg


def _sim_stages(topo: Topology, run: Run, cal: Calibration, modes: Sequence[str],
                seeds: int = 1) -> dict[str, dict[str, float | None]]:
    """Per mode, the mean stages, JCT and TTFT p50 of `run`'s configuration simulated (testbed
    seconds): with jitter, each a mean over seeds 0 .. seeds-1."""
    per_seed = []
    for seed in range(seeds if cal.jitter else 1):
        res, cfg, topo, wcfg = _run_sim(run, cal, seed, modes, topo)
        summ = summarize(res, cfg, topo, wcfg, "testbed")
        out = {}
        for m, r in res.items():
            st = stages(r.records)
            st["jct"] = r.jct_s
            st["ttft_p50"] = summ["modes"][m]["ttft_s"]["p50"] * cfg.dilation
            out[m] = st
        per_seed.append(out)
    if len(per_seed) == 1:
        return per_seed[0]
    return {m: {k: (None if any(x[m][k] is None for x in per_seed) else statistics.fmean(x[m][k] for x in per_seed))
                for k in per_seed[0][m]} for m in per_seed[0]}


def _residuals(sim: dict, tgt: dict) -> np.ndarray:
    out = []
    for m, t in tgt.items():
        for k, w in WEIGHTS.items():
            a, b = sim[m].get(k), t.get(k)
            if a is None or b is None or b <= 0:
                continue
            out.append(w * (a - b) / b)
    return np.array(out)


def run_label(run: Run) -> str:
    """A run's configuration in tables: its topology, and its APS when online."""
    return config_name(run) + (f"@{run.aps:g}aps" if run.aps else "")


def _levenberg_marquardt(res_of: Callable[[np.ndarray], np.ndarray], x: np.ndarray, iterations: int,
                         progress: Callable[[str], None]) -> tuple[np.ndarray, np.ndarray, int]:
    """Minimise |res_of(x)|^2 over x >= 0 (forward-difference Jacobian): (x, its residuals, the
    simulations it took)."""
    r = res_of(x)
    lam = 1e-2
    evals = 1
    for it in range(iterations):
        J = np.zeros((len(r), len(x)))
        for i in range(len(x)):
            h = max(2e-5, 0.05 * abs(x[i]))
            xp = x.copy()
            xp[i] += h
            J[:, i] = (res_of(xp) - r) / h
            evals += 1
        g = J.T @ r
        A = J.T @ J
        # a latency at 0 that the gradient pushes below 0 stays there: the step is solved over the
        # others (else clipping it afterwards leaves the others where a negative latency wanted them)
        free = ~((x <= 0) & (g > 0))
        if not free.any():
            break
        Af, gf = A[np.ix_(free, free)], g[free]
        improved = False
        for _ in range(6):
            step = np.zeros_like(x)
            step[free] = np.linalg.solve(Af + lam * np.diag(np.diag(Af) + 1e-12), -gf)
            xn = np.maximum(x + step, 0.0)
            rn = res_of(xn)
            evals += 1
            if rn @ rn < r @ r:
                x, r, lam, improved = xn, rn, lam / 3, True
                break
            lam *= 4
        progress(f"  fit iteration {it + 1}: rms relative error {math.sqrt(r @ r / len(r)):.4f}")
        if not improved:
            break
    return x, r, evals


def burst_of(folder: Path, topology: str) -> tuple[dict[str, float], dict[str, Any]]:
    """A `dualpath bench burst` folder's mean extra bytes per NIC kind (a negative mean, within the
    timing's noise on a fast link, counts as 0) and its provenance; refused when it was measured
    on another topology's links."""
    try:
        b = json.loads((Path(folder) / "summary.json").read_text())
        measured = {str(k): float(v["mean_extra_payload_bytes"]) for k, v in b["kinds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{folder}: not a `dualpath bench burst` folder ({type(e).__name__}: {e})") from None
    if b.get("topology") != topology:
        raise ValueError(f"{folder}: measured on {b.get('topology')!r}'s links, the runs are {topology!r}'s; "
                         f"fix: dualpath bench burst topologies/{topology}.yaml")
    extra = {k: max(0.0, v) for k, v in measured.items()}
    return extra, {"folder": str(folder), "command": b.get("command"), "measured_payload_bytes": measured}


def calibrate(runs: Sequence[Run], progress: Callable[[str], None] = print, iterations: int = 8,
              cores: float | None = None, burst: Path | None = None) -> Calibration:
    """Fit a Calibration on run folders of one topology (see the module docstring); `burst`: a
    `dualpath bench burst` folder of the same topology, whose measured extra bytes the fit uses."""
    t_start = time.monotonic()
    runs = list(runs)
    if not runs:
        raise ValueError("calibration needs at least one testbed run")
    for run in runs:
        if not run.faithful():
            raise ValueError(f"{run.path}: not FAITHFUL in every mode ({run.unfaithful()}); no calibration from it")
    if len({json.dumps(topology_contents(r), sort_keys=True) for r in runs}) > 1:  # by contents: a reproduce run's name says its overrides
        raise ValueError(f"calibration runs must share one topology (the held-out ones are judged apart), got "
                         f"{', '.join(sorted({r.topology for r in runs}))}")
    extra, burst_source = burst_of(burst, runs[0].topology) if burst else ({}, None)
    cores = float(cores or os.cpu_count() or 2)
    host = fit_host(runs, cores)
    host_fit = host.pop("_fit")
    ladder = next((r for r in runs if {"basic", "layerwise"} <= set(r.modes)), runs[0])
    exposed, io_evidence = exposed_io(ladder)
    progress(f"  host: {cores:g} cores, busy {host['cpu_base']:.3f} + {host['cpu_per_compute']:.3f} x engine compute "
             f"+ {host['cpu_per_mbps']:.4f} x KV MB/s; engines' transfers {'exposed' if exposed else 'overlapped'}")
    fits = [(run, run_topology(run), _targets(run, list(run.modes))) for run in runs]
    x = np.array([INITIAL[k] for k in LATENCIES])

    jitter = 0.0

    def cal_of(v: np.ndarray) -> Calibration:
        return Calibration(**{k: float(max(0.0, a)) for k, a in zip(LATENCIES, v)}, exposed_io=exposed,
                           dilation=runs[0].dilation, jitter=jitter, burst_extra_bytes=extra, **host)

    def sims(v: np.ndarray) -> list[dict]:
        c = cal_of(v)
        return [_sim_stages(topo, run, c, list(tgt), FIT_SEEDS) for run, topo, tgt in fits]

    def res_of(v: np.ndarray) -> np.ndarray:
        return np.concatenate([_residuals(sim, tgt) for sim, (_, _, tgt) in zip(sims(v), fits)])

    x, r, evals = _levenberg_marquardt(res_of, x, iterations, progress)
    for rnd in range(2):  # the jitter for these latencies, then the latencies again with it (and its jitter)
        jitter, jitter_fit = fit_jitter(runs, cal_of(x))
        progress(f"  jitter: each latency varies by {jitter:.2f} (relative sd) from one message to the next: the "
                 f"{' and '.join(JITTER_STAGES)} stages then vary {jitter_fit.get('sim_mean_dispersion')} (testbed "
                 f"{jitter_fit.get('testbed_mean_dispersion')}, without jitter "
                 f"{jitter_fit.get('sim_mean_dispersion_without_jitter')})")
        if rnd or not jitter:
            break
        progress(f"  the latencies again, with the jitter (each simulation a mean over {FIT_SEEDS} seeds):")
        x, r, more = _levenberg_marquardt(res_of, x, iterations, progress)
        evals += more
    cal = cal_of(x)
    residual_table = {}
    for final, (run, _, tgt) in zip(sims(x), fits):
        residual_table[run_label(run)] = {
            m: {k: (None if final[m].get(k) is None or tgt[m].get(k) in (None, 0) else round(final[m][k] / tgt[m][k] - 1, 4))
                for k in WEIGHTS} for m in tgt}
    sources = [{"run": str(run.path), "command": run.summary.get("command"), "topology": run.topology,
                "aps": run.aps or 0.0, "summary_sha256": digest(run), "config": config_identity(run),
                "modes": list(run.modes)} for run in runs]
    source = {**sources[0], "runs": sources, "dilation": runs[0].dilation,
              "fitted_by": "dualpath sim --calibrate", "fit_s": round(time.monotonic() - t_start, 1),
              "simulations": evals, "rms_relative_error": round(math.sqrt(r @ r / len(r)), 5),
              "relative_error_per_run_and_mode": residual_table, "host_fit": host_fit, "io_evidence": io_evidence,
              "weights": WEIGHTS, "jitter_fit": jitter_fit, "burst": burst_source}
    return Calibration(**{**cal.to_dict(), "source": source})


# The stages made of the software's latencies (and the queues the simulator has): how much they vary
# from one request to the next measures how much one latency varies from one message to the next.
JITTER_STAGES = ("route", "writeback")


JITTER_SEEDS = 3


# With jitter, each simulation of the latencies' fit is a mean over this many seeds (common to every
# step, so a step's change is the latencies', not the draws')
FIT_SEEDS = 3


JITTER_MAX = 4.0


def _stage_dispersions(records_per_mode: dict[str, Sequence]) -> dict[tuple[str, str], float]:
    out = {}
    for m, recs in records_per_mode.items():
        smp = stage_samples(recs)
        for k in JITTER_STAGES:
            d = dispersion(smp[k])
            if d is not None:
                out[(m, k)] = d
    return out


def fit_jitter(runs: Sequence[Run], cal: Calibration, seeds: int = JITTER_SEEDS,
               iterations: int = 10) -> tuple[float, dict[str, Any]]:
    """Step 4: the latencies' jitter, by bisection on [0, JITTER_MAX]: the simulated requests'
    JITTER_STAGES must vary from one request to the next (dispersion) as much as the testbed's, on
    average over every run, mode and stage (each simulated dispersion a mean over `seeds`)."""
    tb = {(i, *k): d for i, run in enumerate(runs)
          for k, d in _stage_dispersions({m: run.records(m) for m in run.modes}).items()}
    if not tb:
        return 0.0, {"note": f"too few requests per mode to measure the {'/'.join(JITTER_STAGES)} stages' dispersion"}

    def simulated(sd: float) -> dict[tuple, float]:
        acc: dict[tuple, list[float]] = {}
        for i, run in enumerate(runs):
            for seed in range(seeds if sd else 1):  # without jitter every seed simulates the same
                res = _run_sim(run, replace(cal, jitter=sd), seed)[0]
                for k, d in _stage_dispersions({m: r.records for m, r in res.items()}).items():
                    acc.setdefault((i, *k), []).append(d)
        return {k: statistics.fmean(v) for k, v in acc.items()}

    def gap(sd: float) -> tuple[float, dict[tuple, float]]:
        sim = simulated(sd)
        keys = [k for k in tb if k in sim]
        return statistics.fmean(sim[k] - tb[k] for k in keys), sim

    lo, hi = 0.0, JITTER_MAX
    g0, sim = gap(lo)
    g_hi, sim_hi = gap(hi) if g0 < 0 else (0.0, sim)
    if g0 >= 0:
        sd = 0.0
    elif g_hi < 0:
        sd, sim = hi, sim_hi
    else:
        for _ in range(iterations):
            mid = (lo + hi) / 2
            g, s_mid = gap(mid)
            if g < 0:
                lo = mid
            else:
                hi, sim = mid, s_mid
        sd = hi
    keys = [k for k in tb if k in sim]
    return round(sd, 4), {
        "stages": list(JITTER_STAGES), "seeds": seeds, "dispersion": "interquartile range / 1.349 / median",
        "testbed_mean_dispersion": round(statistics.fmean(tb[k] for k in keys), 4),
        "sim_mean_dispersion": round(statistics.fmean(sim[k] for k in keys), 4),
        "sim_mean_dispersion_without_jitter": round(statistics.fmean(tb[k] for k in keys) + g0, 4)}


# Topology fields added after calibrations began to record their runs' configurations: at their
# defaults they describe the cluster those runs had, so they are left out and the recorded
# identities still match (with them in, every run became "held out" from its own fit).
LATER_FIELDS = ("connector", "store", "servers", "place", "tunnel")
LATER_TARGET_FIELDS = ("hbm_length_scale",)  # the same, inside `target:`


def topology_contents(run: Run) -> dict[str, Any]:
    """The run's topology as the cluster it describes, whatever its name (a reproduce run's is
    derived from its overrides)."""
    spec = run_topology(run).spec
    fields = type(spec).model_fields
    at_default = {f for f in LATER_FIELDS if getattr(spec, f) == fields[f].get_default(call_default_factory=True)}
    target_fields = type(spec.target).model_fields
    target_at_default = {f for f in LATER_TARGET_FIELDS if getattr(spec.target, f) == target_fields[f].get_default()}
    return spec.model_dump(mode="json", exclude={"name": True, "description": True, **{f: True for f in at_default},
                                                 "target": target_at_default})


def config_identity(run: Run) -> str:
    """What runs of one configuration share (repeats of it differ only by the order of events),
    whatever made them (`dualpath run` or `dualpath reproduce`, under any topology name): the
    topology's contents, geometry, workload, arrivals, quota; a digest."""
    key = json.dumps([topology_contents(run), repr(run_geometry(run)), repr(workload_of_run(run.summary)), run.aps or 0.0,
                      arrival_seed(run), run.summary.get("quota_s")], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]
