"""The simulator against the testbed: calibration on one configuration, validation on others.

`calibrate(runs)` fits every constant the simulator takes from testbed measurements
(simulator/calibration.py) on FAITHFUL run folders of one topology (its offline ladder, and
an online point beside it: the testbed's control plane costs less per message when requests
arrive one at a time than in an offline run's bursts, and one latency per message must serve
both), in three steps:
  1. the testbed model's compute per prefill pass and per decode step (passes.jsonl, steps.jsonl:
     least squares of compute_wall_s on requests and predicted emulated seconds, coefficients
     >= 0), and the host's CPU (the modes' cpu_busy against those engines' compute and the KV
     bytes over every NIC: least squares over every run's modes);
  2. whether the engines' transfers hide behind their layer windows: they do not when a
     layerwise pass costs as much beyond its windows as a basic one (the testbed's NIXL over
     UCX/TCP moves a transfer only while its engine waits on it), judged on the first run with
     both modes;
  3. the latencies, by Levenberg-Marquardt on the simulator itself: simulate every run's modes and
     match, per mode, the mean time from arrival to the read (routing), of the read (the one stage
     that identifies a store load's own latency: in an online run most reads find their SNIC idle),
     of prefill (from the read's end to the first token), from the first token to the second (the P->D hand-over), per token
     after it, and from the last token to the request's end (write-back), plus the mode's JCT and
     TTFT p50, all as relative errors, every latency exactly its value;
  4. the latencies' jitter (how much each varies from one message to the next), by bisection: the
     simulated requests' routing and write-back stages must vary from one request to the next as
     much as the testbed's do; then step 3 again with that jitter, each simulation a mean over
     FIT_SEEDS seeds (jitter lengthens an offline run's slowest chain, so latencies fitted without
     it come out long), and the jitter once more for the new latencies.
The result is written with the runs it came from (path, command, topology, APS, dilation, a digest
of each summary.json), the residuals and the time the fit took.

`validate_to_folder(runs, cal, ...)` simulates each configuration (its topology as the file is
now, its workload, its modes) and compares per mode: JCT, TTFT p50/p99, TPOT p50 (relative errors)
and SNIC max/avg (difference); a run on the calibration's own configuration is not held out. Runs
of one configuration (repeats) are compared by their mean; with the calibration's jitter, the
simulated side is the mean of REPLICAS seeded simulations, and each error has its noise (the
standard error the order of events alone gives it). Each row also says how far its prediction
moves when one fitted latency moves by 10 % (its band).
"""
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
from testbed.measure.metrics import percentiles, token_latencies
from testbed.paths import REPO
from testbed.sim.drive import Geometry, sim_config, simulate, summarize, trace_of_run, trajectories, workload_of_run
from testbed.topology import Topology

STAGES = ("route", "read", "prefill", "handover", "tpot", "writeback")
LATENCIES = ("rpc_s", "pass_fixed_s", "xfer_latency_s", "step_gap_s", "flush_fixed_s", "read_contention_s",
             "load_fixed_s")
INITIAL = {"rpc_s": 2e-3, "pass_fixed_s": 2e-3, "xfer_latency_s": 3e-4, "step_gap_s": 5e-4, "flush_fixed_s": 3e-3,
           "read_contention_s": 1e-2, "load_fixed_s": 1e-3}
# Acceptance (issue 15): mean JCT error <= 2 %, max <= 5 %, TTFT p50 <= 5 %, SNIC max/avg within 0.05
TARGETS = {"mean_jct_err": 0.02, "max_jct_err": 0.05, "ttft_p50_err": 0.05, "snic_balance_diff": 0.05}
# A median with the TTFTs at p45 and p55 this far apart (relative to it) lies between two modes of
# the distribution (e.g. round-robin's PE-side and DE-side reads): one request more or less on a side
# moves it across the gap, so its error says little (the report says so beside the row).
MEDIAN_GAP = 0.5
# Each fitted latency is moved by this share, one at a time, and the row records how far its
# prediction moves: a row whose band is wider than its target is decided by the order of events
# (e.g. which request round-robin sends to which side), not by the model's rates.
SPREAD_STEP = 0.1
# With the calibration's jitter, a row's simulated value is the mean of this many simulations (seeds
# 0, 1, ...): an offline JCT is a max over agents' noisy chains, one draw of which moves by about
# as much as the testbed's own repeats do.
REPLICAS = 8
# below this many KV bytes through the storage NICs (oracle: control frames only) a mode has no
# SNIC balance to compare
MIN_SNIC_BYTES = 1 << 20


# --------------------------------------------------------------------------- per-request stages

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


# --------------------------------------------------------------------------- the run's configuration

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


# --------------------------------------------------------------------------- 1. compute and host CPU

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


# --------------------------------------------------------------------------- 3. latencies

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


# --------------------------------------------------------------------------- 4. jitter

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


def held_out(run: Run, cal: Calibration) -> bool:
    """Whether `run`'s configuration (config_identity) is none of those `cal` was fitted on. A
    calibration written before it recorded them is judged by (topology name, online) alone."""
    fitted = cal.source.get("runs", [cal.source])
    if all("config" in s for s in fitted):
        return config_identity(run) not in {s["config"] for s in fitted}
    return (run.topology, bool(run.aps)) not in {(s.get("topology"), bool(s.get("aps"))) for s in fitted}


# --------------------------------------------------------------------------- validation

def _rel(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b - 1, 5)


def ttfts(records: Sequence) -> list[float]:
    """Each completed request's time to first token, in its records' units."""
    return [token_latencies(_get(r, "t_arrive"), _get(r, "token_times"))["ttft"] for r in records
            if not _get(r, "error") and _get(r, "token_times")]


def median_gap(values: Sequence[float]) -> tuple[float, float, float] | None:
    """(p45, p55, (p55 - p45) / p50) of `values`; None when there are none."""
    q = percentiles(values, (45, 50, 55))
    if q["p50"] is None:
        return None
    return q["p45"], q["p55"], (q["p55"] - q["p45"]) / q["p50"] if q["p50"] else math.inf


def topology_contents(run: Run) -> dict[str, Any]:
    """The run's topology as the cluster it describes, whatever its name (a reproduce run's is
    derived from its overrides)."""
    return run_topology(run).spec.model_dump(mode="json", exclude={"name", "description"})


def config_identity(run: Run) -> str:
    """What runs of one configuration share (repeats of it differ only by the order of events),
    whatever made them (`dualpath run` or `dualpath reproduce`, under any topology name): the
    topology's contents, geometry, workload, arrivals, quota; a digest."""
    key = json.dumps([topology_contents(run), repr(run_geometry(run)), repr(workload_of_run(run.summary)), run.aps or 0.0,
                      arrival_seed(run), run.summary.get("quota_s")], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def group_repeats(runs: Sequence[Run]) -> list[list[Run]]:
    """`runs` by configuration, in the order each first appears."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(config_identity(run), []).append(run)
    return list(groups.values())


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.fmean(xs), 6) if xs else None


def _sd(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.stdev(xs), 6) if len(xs) > 1 else None


METRICS = {"jct_s": lambda v: v["jct_s"], "ttft_p50": lambda v: v["ttft_s"]["p50"],
           "ttft_p99": lambda v: v["ttft_s"]["p99"], "tpot_p50": lambda v: v["tpot_s"]["p50"],
           "snic": lambda v: v.get("snic_max_over_avg"), "agent_jct_mean": lambda v: (v.get("agent_jct_s") or {}).get("mean")}


def validate_config(runs: Sequence[Run], cal: Calibration, progress: Callable[[str], None] = print,
                    replicas: int = REPLICAS) -> list[dict[str, Any]]:
    """Per mode of one configuration's testbed runs (its repeats: the mean of those with the mode),
    the simulator's errors: with the calibration's jitter, against the mean of `replicas` simulations
    of seeds 0, 1, ...; without it, against the one simulation there is."""
    run = runs[0]
    topo = run_topology(run)
    modes = list(dict.fromkeys(m for r in runs for m in r.modes))
    n = max(1, replicas) if cal.jitter else 1
    sims = [_run_sim(run, cal, seed, modes, topo) for seed in range(n)]
    cfg = sims[0][1]
    summs = [summarize(*x, "testbed")["modes"] for x in sims]
    # the band: each nudged calibration's one simulation (seed 0), beside the calibration's own
    nudged = [summarize(*_run_sim(run, c, 0, modes, topo), "testbed")["modes"] for c in nudged_calibrations(cal)]
    out_of_fit = held_out(run, cal)
    rows = []
    for m in modes:
        mine = [r for r in runs if m in r.modes]
        tv = [r.mode(m) for r in mine]
        t = {k: _mean(f(v) for v in tv) for k, f in METRICS.items()}
        sv = {k: [f(x[m]) for x in summs] for k, f in METRICS.items()}
        s = {k: _mean(v) for k, v in sv.items()}
        band = [summs[0][m], *(x[m] for x in nudged)]
        snic_bytes = min(sum(r["measured"] for r in v.get("kv_bytes_vs_expected", {}).get("per_direction", [])
                             if r["nic"].endswith("/snic") and r["dir"] == "rx") for v in tv)
        bal = (None if snic_bytes < MIN_SNIC_BYTES or any(METRICS["snic"](v) is None for v in tv)
               or any(x is None for x in sv["snic"]) else round(s["snic"] - t["snic"], 4))
        rows.append({
            "config": run_label(run), "mode": m, "held_out": out_of_fit,
            "faithful": all(bool(v.get("faithful")) for v in tv), "run": str(mine[0].path),
            "runs": [str(r.path) for r in mine], "replicas": n,
            "jct_s": {"testbed": t["jct_s"], "sim": s["jct_s"], "testbed_runs": [METRICS["jct_s"](v) for v in tv],
                      "sim_sd": _sd(sv["jct_s"])},
            "jct_err": _rel(s["jct_s"], t["jct_s"]),
            "ttft_p50_s": {"testbed": t["ttft_p50"], "sim": s["ttft_p50"],
                           "testbed_runs": [METRICS["ttft_p50"](v) for v in tv], "sim_sd": _sd(sv["ttft_p50"])},
            "ttft_p50_err": _rel(s["ttft_p50"], t["ttft_p50"]),
            "ttft_p99_err": _rel(s["ttft_p99"], t["ttft_p99"]),
            "tpot_p50_err": _rel(s["tpot_p50"], t["tpot_p50"]),
            "snic_max_over_avg": {"testbed": t["snic"], "sim": s["snic"]}, "snic_balance_diff": bal,
            **_median_modes([x for r in mine for x in r.records(m)], [x for r, *_ in sims for x in r[m].records],
                            run.dilation / cfg.dilation),
            "jct_noise": noise(sv["jct_s"], len(mine)), "ttft_p50_noise": noise(sv["ttft_p50"], len(mine)),
            "jct_spread": spread([b["jct_s"] for b in band], t["jct_s"]),
            "ttft_p50_spread": spread([b["ttft_s"]["p50"] for b in band], t["ttft_p50"]),
            "agent_jct_mean_err": _rel(s["agent_jct_mean"], t["agent_jct_mean"]),
            "sim_wall_s": round(sum(x[m]["simulation"]["wall_s"] for x in summs), 2)})
        r = rows[-1]
        how = (f"  ({len(mine)} runs" if len(mine) > 1 else "  (1 run") + (f", {n} simulations)" if n > 1 else ")")
        progress(f"  {r['config']:>10} {m:<12} JCT {_pct(r['jct_err'])}  TTFT p50 {_pct(r['ttft_p50_err'])}"
                 f"  p99 {_pct(r['ttft_p99_err'])}  TPOT {_pct(r['tpot_p50_err'])}  SNIC {_diff(bal)}"
                 f"{'' if out_of_fit else '  (calibration)'}{how}")
    return rows


def noise(simulated: Sequence[float | None], runs: int) -> float | None:
    """One standard error of a row's relative error from the order of events alone: the
    simulations' spread (the model's estimate of one run's) over their mean, for the mean of
    these simulations against the mean of `runs` testbed runs. None from a single simulation."""
    xs = [x for x in simulated if x is not None]
    if len(xs) < 2 or not statistics.fmean(xs):
        return None
    return round(statistics.stdev(xs) / statistics.fmean(xs) * math.sqrt(1 / len(xs) + 1 / max(1, runs)), 5)


def nudged_calibrations(cal: Calibration, step: float = SPREAD_STEP) -> list[Calibration]:
    """`cal` with one fitted latency at a time moved down and up by `step` (those it fitted non-zero)."""
    return [replace(cal, **{f: getattr(cal, f) * x}) for f in LATENCIES if getattr(cal, f)
            for x in (1 - step, 1 + step)]


def spread(predictions: Sequence[float | None], measured: float | None) -> float | None:
    """How far the predictions range (max - min), relative to the measured value."""
    xs = [x for x in predictions if x is not None]
    if not xs or not measured:
        return None
    return round((max(xs) - min(xs)) / measured, 5)


def _median_modes(tb_records: Sequence, sim_records: Sequence, tb_per_sim: float) -> dict[str, Any]:
    """The TTFTs around each side's median (testbed seconds) and whether the testbed's median lies
    between two modes (MEDIAN_GAP); if it does, each read path's own TTFT median on both sides,
    since round-robin's two modes are its two paths and each has a median that means something."""
    tb, sim = median_gap(ttfts(tb_records)), median_gap([t * tb_per_sim for t in ttfts(sim_records)])
    between = bool(tb and tb[2] > MEDIAN_GAP)
    out = {"ttft_p45_p55_s": {"testbed": tb and [round(tb[0], 4), round(tb[1], 4)],
                              "sim": sim and [round(sim[0], 4), round(sim[1], 4)]},
           "ttft_p50_between_modes": between}
    if between:
        per_path = {}
        for path in sorted({_get(r, "path") for r in tb_records} - {None}):
            t = percentiles(ttfts([r for r in tb_records if _get(r, "path") == path]), (50,))["p50"]
            s = percentiles([x * tb_per_sim for x in ttfts([r for r in sim_records if _get(r, "path") == path])],
                            (50,))["p50"]
            per_path[path] = {"testbed": t and round(t, 4), "sim": s and round(s, 4), "err": _rel(s, t)}
        out["ttft_p50_per_path_s"] = per_path
    return out


def _per_path_medians(per_path: dict[str, dict[str, Any]] | None) -> str:
    """The report line's tail naming each read path's TTFT median, testbed against simulated;
    empty without per-path medians."""
    parts = [f"{path.upper()} path {v['testbed']:.3g} s against {v['sim']:.3g} s ({_pct(v['err']).strip()})"
             for path, v in (per_path or {}).items() if v.get("testbed") and v.get("sim")]
    return (", and each read path's own median (testbed, simulated): " + "; ".join(parts)) if parts else ""


def _pct(x: float | None) -> str:
    return "   n/a" if x is None else f"{x * 100:+5.1f}%"


def _noise(x: float | None) -> str:
    return "" if x is None else f" (±{x * 100:.1f}%)"


def _diff(x: float | None) -> str:
    return "  n/a" if x is None else f"{x:+.3f}"


def aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def stat(key, sel=lambda r: True, f=max):
        xs = [abs(r[key]) for r in rows if sel(r) and r.get(key) is not None]
        return round(f(xs), 5) if xs else None

    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    out = {
        "mean_jct_err": stat("jct_err", f=mean), "max_jct_err": stat("jct_err"),
        "held_out_mean_jct_err": stat("jct_err", lambda r: r["held_out"], mean),
        "held_out_max_jct_err": stat("jct_err", lambda r: r["held_out"]),
        "max_ttft_p50_err": stat("ttft_p50_err"), "mean_ttft_p50_err": stat("ttft_p50_err", f=mean),
        "held_out_max_ttft_p50_err": stat("ttft_p50_err", lambda r: r["held_out"]),
        "max_ttft_p99_err": stat("ttft_p99_err"), "max_tpot_p50_err": stat("tpot_p50_err"),
        "max_snic_balance_diff": stat("snic_balance_diff"),
        "max_jct_spread": stat("jct_spread"), "max_ttft_p50_spread": stat("ttft_p50_spread"),
        "all_faithful": all(r["faithful"] for r in rows),
    }
    out["targets"] = TARGETS
    out["meets_targets"] = bool(rows) and all(v is not None for v in (out["mean_jct_err"], out["max_jct_err"])) and \
        out["mean_jct_err"] <= TARGETS["mean_jct_err"] and out["max_jct_err"] <= TARGETS["max_jct_err"] and \
        (out["max_ttft_p50_err"] or 0) <= TARGETS["ttft_p50_err"] and \
        (out["max_snic_balance_diff"] or 0) <= TARGETS["snic_balance_diff"] and out["all_faithful"]
    return out


def scatter(rows: list[dict[str, Any]], path: Path) -> Path:
    """Simulated against measured: JCT and TTFT p50 per configuration and mode."""
    from testbed.measure import plots

    fig, axes = plots.plt.subplots(1, 2, figsize=(10.5, 4.6), dpi=plots.DPI)
    for ax, key, what in ((axes[0], "jct_s", "JCT"), (axes[1], "ttft_p50_s", "TTFT p50")):
        xs, ys = [], []
        for r in rows:
            a, b = r[key]["testbed"], r[key]["sim"]
            if a is None or b is None:
                continue
            xs.append(a)
            ys.append(b)
            runs = r[key].get("testbed_runs") or []
            if r[key].get("sim_sd") or len(runs) > 1:  # the simulations' sd; the testbed runs' range
                ax.errorbar([a], [b], yerr=r[key].get("sim_sd"),
                            xerr=[[a - min(runs)], [max(runs) - a]] if len(runs) > 1 else None,
                            color=plots.color(r["mode"]), lw=0.8, capsize=2, zorder=1)
            ax.scatter([a], [b], color=plots.color(r["mode"]), marker="o" if r["held_out"] else "s",
                       s=34, edgecolors="black" if not r["held_out"] else "none", linewidths=0.6, zorder=2)
        lo, hi = min(xs + ys) * 0.9, max(xs + ys) * 1.1
        ax.plot([lo, hi], [lo, hi], color="#444444", lw=0.8)
        ax.fill_between([lo, hi], [lo * 0.95, hi * 0.95], [lo * 1.05, hi * 1.05], color="#bbbbbb", alpha=0.3, lw=0,
                        label="within 5 %")
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # plain seconds at 1, 2, 5 x 10^k, not powers of ten
            axis.set_major_locator(plots.mticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(plots.mticker.FormatStrFormatter("%g"))
            axis.set_minor_formatter(plots.mticker.NullFormatter())
        ax.set_xlabel(f"testbed {what} (emulated s)")
        ax.set_ylabel(f"simulated {what} (emulated s)")
        ax.set_title(f"{what}: simulated against measured")
        ax.grid(True, alpha=0.3)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], marker="o", ls="", color=plots.color(m), label=plots.label(m))
               for m in dict.fromkeys(r["mode"] for r in rows)]
    handles.append(Line2D([], [], marker="s", ls="", color="white", markeredgecolor="black", label="calibration config"))
    axes[1].legend(handles=handles, loc="upper left", fontsize=7)
    plots.caption(fig, "Each point is one mode of one testbed configuration; squares are the configuration the "
                       "simulator was calibrated on, circles are held out. The band is +-5 %. Bars: the simulations' "
                       "standard deviation (vertical) and the range of a configuration's testbed runs (horizontal).")
    return plots.save(fig, path)


def code_lines(codes: dict[str, dict[str, Any] | None],
               calibration_codes: dict[str, dict[str, Any] | None] | None = None) -> list[str]:
    """What the report says about the code each testbed run was made on (summary.json's `code`),
    and, given the calibration's runs' codes, whether the calibration was fitted on the same code."""
    known = {p: c for p, c in codes.items() if c}
    commits = {c["commit"] for c in known.values()}
    if not known:
        lines = ["Code: no run records the commit it was made on (made before runs recorded it)."]
    else:
        dirty = any(c.get("dirty") for c in known.values())
        lines = ["Code: " + "; ".join(f"`{p}` {c['commit'][:12]}{' (dirty)' if c.get('dirty') else ''}"
                                      for p, c in known.items())
                 + (f"; {len(codes) - len(known)} run(s) record none" if len(known) < len(codes) else "") + "."]
        if len(commits) > 1 or dirty:
            lines.append(f"WARNING: the runs come from {len(commits)} commit(s){' and uncommitted changes' if dirty else ''}: "
                         "a run made on other code measures another testbed (`git diff` between them, under dualpath/ "
                         "and emulators/, shows what changed); re-make the older runs before trusting the errors.")
    if calibration_codes is None:
        return lines
    # The calibration's latencies are the testbed software's own costs: fitted on runs of older
    # code, they describe a testbed that is gone (2026-12: runs of 226 commits later spent 14 %
    # less time beyond a pass's windows, and every lightly loaded prediction came out long).
    fitted = {c["commit"] for c in calibration_codes.values() if c}
    if not fitted:
        lines.append("WARNING: the calibration's runs record no commit (made before runs recorded it, or their "
                     "folders are gone), so nothing says it models the code these runs were made on; re-fit it on "
                     "runs of that code (`dualpath sim --calibrate`).")
    elif fitted != commits:
        lines.append(f"WARNING: the calibration was fitted on runs of {', '.join(sorted(c[:12] for c in fitted))}, "
                     "not (only) the code of these runs: its latencies are another testbed's if the code changed "
                     "in between; re-fit it on runs of this code (`dualpath sim --calibrate`).")
    else:
        lines.append("Calibration: fitted on runs of the same code.")
    return lines


def calibration_codes(cal: Calibration) -> dict[str, dict[str, Any] | None]:
    """The code each of the calibration's runs was made on, from its folder's summary.json (a path
    relative to the repository); None where the folder is gone or its run records none."""
    out: dict[str, dict[str, Any] | None] = {}
    for s in cal.source.get("runs", []):
        if not s.get("run"):
            continue
        path = Path(s["run"])
        path = path if path.is_absolute() else REPO / path
        try:
            out[s["run"]] = json.loads((path / "summary.json").read_text()).get("code")
        except (OSError, ValueError):
            out[s["run"]] = None
    return out


def ensemble_line(cal: Calibration, rows: list[dict[str, Any]]) -> str:
    """What a row's two sides are: a mean over the testbed's repeats, a mean over seeded simulations."""
    n = max((r.get("replicas") or 1 for r in rows), default=1)
    sim = (f"Each simulated value is the mean of {n} simulations (seeds 0-{n - 1}; sd beside it): the calibration's "
           f"latencies vary by {cal.jitter:.2f} (relative sd) from one message to the next, as the testbed's do, so "
           "one simulation is one draw of the order of events." if cal.jitter and n > 1 else
           "Each simulated value is one simulation (every latency exactly its value).")
    noise = (" In brackets after an error, its noise: one standard error of the difference from the order of "
             "events alone (the simulations' spread, the model's estimate of one run's, over these simulations and the "
             "row's testbed runs); an error within about twice its noise cannot be told from run-to-run variation with "
             "this many runs, and still counts against the targets." if cal.jitter and n > 1 else "")
    return (sim + " A configuration run more than once on the testbed (same topology, workload, seeds) is compared "
            "with the mean of its runs (each in brackets)." + noise)


def report_lines(command: str, cal: Calibration, rows: list[dict[str, Any]], agg: dict[str, Any],
                 codes: dict[str, dict[str, Any] | None] | None = None,
                 cal_codes: dict[str, dict[str, Any] | None] | None = None) -> list[str]:
    src = cal.source
    fitted = " and ".join(f"`{s.get('run')}` (summary sha256 {s.get('summary_sha256')})" for s in src.get("runs", [src]))
    lines = [f"# dualpath sim --validate", "", f"Produced by `{command}`.", "",
             f"Calibration: fitted on {fitted} ({src.get('topology')}, dilation {src.get('dilation')}) by "
             f"`{src.get('fitted_by')}`; "
             f"{src.get('simulations')} simulations, rms relative error {src.get('rms_relative_error')}.", "",
             ensemble_line(cal, rows), "",
             "| config | mode | held out | runs | JCT testbed | JCT sim | JCT err (noise) | TTFT p50 err (noise) | TTFT p99 err | TPOT p50 err | SNIC max/avg (tb / sim) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        sb = r["snic_max_over_avg"]
        tb_runs = r["jct_s"].get("testbed_runs") or []
        sd = r["jct_s"].get("sim_sd")
        lines.append(f"| {r['config']} | {r['mode']} | {'yes' if r['held_out'] else 'no'} | {len(tb_runs) or 1} | "
                     f"{r['jct_s']['testbed']:.4g}{' (' + ' / '.join(f'{x:.4g}' for x in tb_runs) + ')' if len(tb_runs) > 1 else ''} | "
                     f"{r['jct_s']['sim']:.4g}{f' (sd {sd:.2g})' if sd is not None else ''} | {_pct(r['jct_err'])}{_noise(r.get('jct_noise'))} | "
                     f"{_pct(r['ttft_p50_err'])}{_noise(r.get('ttft_p50_noise'))} | {_pct(r['ttft_p99_err'])} | "
                     f"{_pct(r['tpot_p50_err'])} | {sb['testbed']} / {sb['sim']}{'' if r['snic_balance_diff'] is not None else ' (n/a: no KV on SNICs)'} |")
    lines += ["", f"Mean |JCT error| {_pct(agg['mean_jct_err'])}, max {_pct(agg['max_jct_err'])}; held out: mean "
                  f"{_pct(agg['held_out_mean_jct_err'])}, max {_pct(agg['held_out_max_jct_err'])}. TTFT p50 max "
                  f"{_pct(agg['max_ttft_p50_err'])} (held out {_pct(agg['held_out_max_ttft_p50_err'])}); SNIC max/avg "
                  f"max difference {agg['max_snic_balance_diff']}. Every testbed run FAITHFUL: {agg['all_faithful']}.",
              f"Targets (issue 15): mean JCT <= 2 %, max <= 5 %, TTFT p50 <= 5 %, SNIC max/avg within 0.05: "
              f"{'met' if agg['meets_targets'] else 'NOT met'}.", ""]
    if codes is not None:
        lines += code_lines(codes, cal_codes) + [""]
    wide = [r for r in rows if (r.get("jct_spread") or 0) > TARGETS["max_jct_err"]
            or (r.get("ttft_p50_spread") or 0) > TARGETS["ttft_p50_err"]]
    lines += [f"Sensitivity: each fitted latency moved by {SPREAD_STEP:.0%}, one at a time (one simulation each, "
              f"seed 0{', jitter on' if cal.jitter else ''}), moves a row's "
              f"prediction at most {_pct(agg.get('max_jct_spread')).strip()} (JCT) and "
              f"{_pct(agg.get('max_ttft_p50_spread')).strip()} (TTFT p50), max - min over the "
              f"{2 * len([f for f in LATENCIES if getattr(cal, f)]) + 1} simulations, relative to the testbed."]
    lines += [f"- {r['config']} {r['mode']}: JCT band {_pct(r['jct_spread']).strip()}, TTFT p50 band "
              f"{_pct(r['ttft_p50_spread']).strip()}: wider than the target, so the order of events (which request "
              "goes where, first), not the model's rates, decides where in it the prediction falls; its error is "
              "counted above." for r in wide]
    lines += [""]
    for r in rows:
        if r.get("ttft_p50_between_modes"):
            q = r["ttft_p45_p55_s"]
            lines += [f"{r['config']} {r['mode']}: its testbed TTFT median lies between two modes (p45 "
                      f"{q['testbed'][0]:.3g} s, p55 {q['testbed'][1]:.3g} s, testbed seconds; simulated "
                      f"{q['sim'][0]:.3g} s and {q['sim'][1]:.3g} s): one request more or less on either side moves "
                      "the median across the gap, so its p50 error is counted above but says little; compare the "
                      "quantiles around it" + _per_path_medians(r.get("ttft_p50_per_path_s")) + ".", ""]
    lines += ["Calibration constants (real seconds of the testbed's software):", "", "```",
              json.dumps(cal.constants(), indent=1), "```"]
    return lines


def validate_to_folder(runs: Sequence[Run], cal: Calibration, folder: Path, command: str,
                       progress: Callable[[str], None] = print, replicas: int = REPLICAS) -> tuple[Path, dict[str, Any]]:
    """`dualpath sim --validate`: every run's rows, the aggregate, summary.json, report.md and the
    scatter plot in `folder`."""
    rows: list[dict[str, Any]] = []
    for group in group_repeats(runs):
        rows += validate_config(group, cal, progress, replicas)
    agg = aggregate(rows)
    folder.mkdir(parents=True, exist_ok=True)
    codes = {str(r.path): r.summary.get("code") for r in runs}
    cal_codes = calibration_codes(cal)
    summary = {"command": command, "faithful": agg["all_faithful"], "validation": rows, **agg,
               "replicas": replicas if cal.jitter else 1,
               "calibration": cal.to_dict(), "runs": [str(r.path) for r in runs], "run_code": codes,
               "calibration_run_code": cal_codes}
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    scatter(rows, folder / "scatter.png")
    (folder / "report.md").write_text("\n".join(report_lines(command, cal, rows, agg, codes, cal_codes)) + "\n")
    return folder, agg
