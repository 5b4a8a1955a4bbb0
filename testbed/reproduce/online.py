"""Online serving (figures 10, 11, 12 left): the SLO, the steady-state rule, the APS search.

Input: online run folders. Each is one `dualpath run` whose agents arrived as a Poisson process
at a known APS (agents per emulated second; summary.json `arrivals.aps`, or the plan.json the
executor writes), with modes basic and dualpath. Every request in records.jsonl carries its own
t_arrive (testbed s; an agent's first turn arrives at the agent's arrival, each later turn when
the previous one finished: zero tool latency, as in the paper) and ttft_s / ttst_s / tpot_s in
emulated seconds. THE CONDUCTOR HAS NO ONLINE RUNNER YET (it starts every agent at once), so
no such folder can be made today; the analysis below is exercised on hand-built folders.

SLO (the paper's, in emulated time): TTFT <= 4 s and TPOT <= 50 ms.

The paper's steady-state rule ends a run when TTFT exceeds 4 s, or when the TTFT of a 150 s
sliding window differs by less than 5 % from that of the window 30 minutes before. Our runs last
tens of emulated seconds, so we use this scaled equivalent, over the requests that arrive after
a warm-up (the first WARMUP share of the agents' arrival span) up to the last agent's arrival
(after it the offered load is no longer the APS: see measured()):
  * windows: the measured span cut into N_WINDOWS equal windows, each with the mean TTFT of the
    requests arriving in it (the paper's sliding window, 150 s of a 30-min lag ~ 1/12; ours 1/8);
  * ttft_ok: no window's mean TTFT above the SLO (the paper stops as soon as it is exceeded);
  * tpot_ok: the mean TPOT of the measured requests at most the SLO;
  * steady: the last window's mean TTFT is at most 5 % (STEADY_TOL) above the window half the
    span earlier (the paper's lag, scaled), or within STEADY_FLOOR of the SLO's TTFT of it
    (TTFTs far below the SLO vary by more than 5 % without a queue building). A TTFT that is
    still rising is a queue that grows: had the run gone on, the SLO would break;
  * meets = ttft_ok and tpot_ok and steady; a failed request is an SLO miss. This is the verdict.
Beside it, not in it: saturated, a storage NIC (the reading resource of both modes) that carried
more than SATURATED of its rate, in either direction, over the measured span. A short run may
not show the TTFT rise that a saturated NIC causes in the paper's 30-minute runs (every agent
has one request in flight, so the queue in front of the NIC is bounded by the agents that have
arrived): the old fig10 --quick passed basic at 3.76 APS with TTFTs under 1 s while its SNIC was
99.4 % busy. The saturation rule once decided verdicts; now `agreement` shows, per run, where it
and the SLO disagree, and the report says so.
The highest APS meeting the SLO is the highest probed APS that meets it with every lower probe
meeting it too; `bisect_next` proposes the next probe between the best pass and the first fail,
until the bracket [met, failed) is within rel_tol of met (`bracket`).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

from testbed.reproduce import paper
from testbed.reproduce.common import mean
from testbed.reproduce.plan import (IO_1P1D_OVERRIDES, OnlineSearch, OnlineSpec, Plan, RunConfig, WorkloadSpec,
                                    io_capacity_aps)
from testbed.measure.runs import Run

WARMUP = 0.2
N_WINDOWS = 8
STEADY_TOL = paper.STEADY_TOL
STEADY_FLOOR = 0.05  # of the SLO's TTFT
# A storage NIC busier than this over the measured span is past what it serves (see slo_verdict).
SATURATED = 0.98
MODES = ("basic", "dualpath")
ARRIVALS_S = {True: 7.0, False: 14.0}  # emulated seconds of arrivals per grid run (--quick, full)
NO_RUNNER = ("none of the runs given has Poisson arrivals (`dualpath run --aps`, or this figure's own runs); "
             "this analysis needs one")
TOPOLOGY = "1p1d-io"


# --------------------------------------------------------------------------- the plan


def capacity_aps(mode: str) -> float:
    """The I/O-bound APS of `mode` on the grid's cluster and workload (its storage NICs' rate)."""
    return io_capacity_aps(RunConfig("probe", TOPOLOGY, MODES, WorkloadSpec(agents=24)), mode)


def online_configs(quick: bool) -> list[RunConfig]:
    """The APS grid of figures 10, 11 and 12 left: 1p1d-io, basic and dualpath, the demo's
    agents arriving at fractions of DualPath's I/O-bound capacity (twice basic's on 1P1D)."""
    cap = capacity_aps("dualpath")
    # full: twice quick's arrivals and one point past DualPath's I/O capacity; four points and 14 s
    # so that the grid and the bisection fit the hour an id may take here (seven points of 20 s
    # took 106 min by --plan before a probe)
    fractions = (0.3, 0.55, 0.8) if quick else (0.3, 0.55, 0.8, 1.05)
    out = []
    for f in fractions:
        aps = round(cap * f, 2)
        agents = grid_agents(aps, quick)
        out.append(RunConfig(f"online/aps={aps:g}", TOPOLOGY, MODES, WorkloadSpec(agents=agents),
                             topology_overrides=dict(IO_1P1D_OVERRIDES), online=OnlineSpec(aps=aps, seed=0),
                             params={"aps": aps}))
    return out


def grid_agents(aps: float, quick: bool) -> int:
    """The agents of a grid point at `aps`: ARRIVALS_S of arrivals, at least a floor."""
    return max(12 if quick else 24, round(aps * ARRIVALS_S[quick]))


def online_plan(fig_id: str, quick: bool) -> Plan:
    cfgs = online_configs(quick)
    return Plan(fig_id, quick, cfgs,
                scale_down=(f"1P1D with a 30 Gbit/s (s = 0.075) storage NIC per node, links x{IO_1P1D_OVERRIDES['scale']:g}; the demo's "
                            "agents (10 turns, ~660-token contexts, 1/50 of the paper's 32K); SLO as the paper's "
                            "(TTFT <= 4 s, TPOT <= 50 ms, emulated); steady-state rule scaled (testbed.reproduce.online)"),
                search=OnlineSearch(MODES, rel_tol=0.1, max_probes=6 if quick else 5))


# --------------------------------------------------------------------------- per request


def requests(run: Run, mode: str) -> list[dict[str, Any]]:
    """The mode's requests in emulated seconds: arrive, ttft, ttst, tpot, done, trajectory, turn,
    error; sorted by arrival."""
    out = []
    for r in run.records(mode):
        if r.get("trajectory", 0) < 0:
            continue  # the warm-up request
        out.append({"trajectory": r["trajectory"], "turn": r["turn"], "arrive": run.emulated(r["t_arrive"]),
                    "done": run.emulated(r["t_done"]), "ttft": r.get("ttft_s"), "ttst": r.get("ttst_s"),
                    "tpot": r.get("tpot_s"), "error": bool(r.get("error"))})
    return sorted(out, key=lambda x: x["arrive"])


def agent_arrivals(reqs: Sequence[dict]) -> dict[int, float]:
    """Each agent's arrival: its first turn's (emulated)."""
    first: dict[int, float] = {}
    for r in reqs:
        first[r["trajectory"]] = min(first.get(r["trajectory"], math.inf), r["arrive"])
    return first


def agent_jcts(reqs: Sequence[dict]) -> list[float]:
    """Each agent's completion time: its last turn's end minus its first turn's arrival (emulated)."""
    last: dict[int, float] = {}
    for r in reqs:
        last[r["trajectory"]] = max(last.get(r["trajectory"], -math.inf), r["done"])
    first = agent_arrivals(reqs)
    return [last[t] - first[t] for t in first]


def measured(reqs: Sequence[dict], warmup: float = WARMUP) -> tuple[list[dict], tuple[float, float]]:
    """The requests arriving after the warm-up and up to the last agent's arrival, and that span.

    The span ends where the Poisson process does: after the last agent arrived, no agent joins,
    the offered load falls below the APS as agents finish their turns, and TTFTs fall with it. A
    span that ran on to the last turn's arrival would end in that drain, which reads as steady:
    it let basic pass the SLO at 1.6x the planner's I/O bound for it (fig10 --quick)."""
    if not reqs:
        return [], (0.0, 0.0)
    first = agent_arrivals(reqs).values()
    t0, t1 = min(first), max(first)
    start = t0 + warmup * (t1 - t0)
    return [r for r in reqs if start <= r["arrive"] <= t1], (start, t1)


def _ttft(r: dict) -> float:
    return math.inf if r["error"] or r["ttft"] is None else r["ttft"]


def windows(reqs: Sequence[dict], span: tuple[float, float], n: int = N_WINDOWS) -> list[tuple[float, float | None, int]]:
    """(window middle, mean TTFT or None if empty, requests) of n equal windows of the span."""
    a, b = span
    w = (b - a) / n if b > a else 0.0
    out = []
    for i in range(n):
        lo, hi = a + i * w, a + (i + 1) * w
        inside = [r for r in reqs if (lo <= r["arrive"] < hi) or (i == n - 1 and r["arrive"] == hi)]
        vals = [_ttft(r) for r in inside]
        out.append(((lo + hi) / 2, (sum(vals) / len(vals)) if vals else None, len(inside)))
    return out


def storage_busy(run: Run, mode: str, span: tuple[float, float]) -> dict[str, float]:
    """Each storage NIC's busiest direction over an emulated span: its bytes over its rate's.
    The link samples are cumulative per NIC; the span's ends are taken at the nearest samples."""
    rates = run.snic_rates_bps(mode)
    samples = [s for s in run.links(mode) if s.get("nics")]
    a, b = (t * run.dilation for t in span)
    if len(samples) < 2 or b <= a:
        return {}
    first = min(samples, key=lambda s: abs(s["t"] - a))
    last = min(samples, key=lambda s: abs(s["t"] - b))
    dt = last["t"] - first["t"]
    out = {}
    for nic, bps in rates.items():
        if dt > 0 and bps > 0 and nic in first["nics"] and nic in last["nics"]:
            moved = max(y - x for x, y in zip(first["nics"][nic], last["nics"][nic]))
            out[nic] = round(moved / (bps / 8 * dt), 4)
    return out


def slo_verdict(reqs: Sequence[dict], slo_ttft: float = paper.SLO_TTFT_S, slo_tpot: float = paper.SLO_TPOT_S,
                warmup: float = WARMUP, n_windows: int = N_WINDOWS,
                busy: dict[str, float] | None = None) -> dict[str, Any]:
    """Whether one mode's run at one APS meets the SLO in steady state (see the module docstring).
    `busy`: the storage NICs' busy shares over the measured span (storage_busy); None skips that test."""
    meas, span = measured(reqs, warmup)
    if not meas:
        return {"meets": False, "reason": "no requests", "windows": []}
    win = windows(meas, span, n_windows)
    means = [m for _, m, _ in win if m is not None]
    ttft_ok = all(m <= slo_ttft for m in means)
    tpots = [r["tpot"] for r in meas if r["tpot"] is not None and not r["error"]]
    tpot_mean = mean(tpots)
    tpot_ok = tpot_mean is None or tpot_mean <= slo_tpot
    filled = [(t, m) for t, m, _ in win if m is not None]
    steady, last, lagged = True, None, None
    if len(filled) >= 2:
        last = filled[-1][1]
        lag_t = filled[-1][0] - (span[1] - span[0]) / 2
        lagged = min(filled, key=lambda x: abs(x[0] - lag_t))[1]
        steady = math.isfinite(last) and (last <= lagged * (1 + STEADY_TOL) or last - lagged <= STEADY_FLOOR * slo_ttft)
    errors = sum(r["error"] for r in meas)
    hot = {nic: b for nic, b in (busy or {}).items() if b >= SATURATED}
    reasons = []
    if not ttft_ok:
        reasons.append(f"a window's mean TTFT {max(means):.3g} s > {slo_ttft:g} s")
    if not tpot_ok:
        reasons.append(f"mean TPOT {tpot_mean * 1e3:.1f} ms > {slo_tpot * 1e3:g} ms")
    if not steady:
        reasons.append(f"TTFT still rising ({lagged:.3g} -> {last:.3g} s over half the span): not steady")
    if errors:
        reasons.append(f"{errors} request(s) failed")
    saturation = ("saturated: " + ", ".join(f"{nic} busy {b:.1%}" for nic, b in sorted(hot.items()))
                  + f" of the span (limit {SATURATED:.0%})") if hot else None
    return {"meets": ttft_ok and tpot_ok and steady and not errors, "ttft_ok": ttft_ok, "saturation": saturation,
            "tpot_ok": tpot_ok, "steady": steady, "saturated": bool(hot), "storage_busy": busy,
            "errors": errors, "reasons": reasons, "tpot_mean": tpot_mean,
            "ttft_last_window": last, "ttft_lagged_window": lagged, "span": list(span), "measured": len(meas),
            "windows": [{"t": t, "ttft_mean": m, "n": n} for t, m, n in win]}


def _pct(xs: Sequence[float], p: float) -> float | None:
    xs = sorted(x for x in xs if x is not None and math.isfinite(x))
    if not xs:
        return None
    pos = (len(xs) - 1) * p / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stat(xs: Iterable[float | None]) -> dict[str, float | None]:
    """mean, p10 and p90 (the band the figures shade) of the values that exist."""
    v = [x for x in xs if x is not None and math.isfinite(x)]
    return {"mean": mean(v), "p10": _pct(v, 10), "p90": _pct(v, 90), "n": len(v)}


def point(run: Run, mode: str, **slo) -> dict[str, Any]:
    """One (APS, mode) point of figures 10 and 11: latencies over the measured requests, the
    agents' mean JCT, and the SLO verdict."""
    reqs = requests(run, mode)
    meas, span = measured(reqs)
    busy = storage_busy(run, mode, span) if meas else None
    return {**point_of(reqs, run.aps, mode, busy, **slo), "faithful": run.faithful([mode])}


def point_of(reqs: Sequence[dict], aps: float, mode: str, busy: dict[str, float] | None = None, **slo) -> dict[str, Any]:
    """A point from its requests (`requests`' form), wherever they came from: a testbed run or a
    simulation (which has no storage NIC counters: `busy` None)."""
    meas, _ = measured(reqs)
    v = slo_verdict(reqs, busy=busy, **slo)
    ok = [r for r in meas if not r["error"]]
    return {"aps": aps, "mode": mode, "ttft": stat(r["ttft"] for r in ok), "ttst": stat(r["ttst"] for r in ok),
            "tpot": stat(r["tpot"] for r in ok), "jct_mean": mean(agent_jcts(reqs)), "agents": len({r["trajectory"] for r in reqs}),
            "meets_slo": v["meets"], "verdict": v}


# --------------------------------------------------------------------------- the search


def capacity(points: Iterable[tuple[float, bool]]) -> float | None:
    """The highest APS meeting the SLO with every lower probed APS meeting it too."""
    best = None
    for aps, ok in sorted(points):
        if not ok:
            break
        best = aps
    return best


def _fails_above_capacity(pts: Sequence[tuple[float, bool]]) -> tuple[float | None, list[float]]:
    """The capacity of sorted probes and the failed probes above it."""
    best = capacity(pts)
    return best, [a for a, ok in pts if not ok and (best is None or a > best)]


def bracketed(points: Iterable[tuple[float, bool]]) -> bool:
    """Whether a probed APS above the capacity failed the SLO: without one the capacity is only
    a lower bound (every probe passed)."""
    return bool(_fails_above_capacity(sorted(points))[1])


def bisect_next(points: Iterable[tuple[float, bool]], rel_tol: float = 0.1) -> float | None:
    """The next APS to probe: the middle between the best pass and the first fail above it, or
    None when they are within rel_tol of each other (or there is no bracket to halve; with only
    passes, double the highest; with only fails, halve the lowest)."""
    pts = sorted(points)
    if not pts:
        return None
    best, fails = _fails_above_capacity(pts)
    if best is None:
        return pts[0][0] / 2 if pts[0][0] > 1e-3 else None
    if not fails:
        return best * 2
    hi = min(fails)
    if (hi - best) <= rel_tol * best * (1 + 1e-9):  # a bracket of exactly rel_tol is done (floats)
        return None
    return (best + hi) / 2


def search(evaluate: Callable[[float], bool], points: Iterable[tuple[float, bool]] = (), rel_tol: float = 0.1,
           max_probes: int = 6) -> tuple[float | None, list[tuple[float, bool]]]:
    """Probe APS values (evaluate(aps) -> meets the SLO) by bisection from the given points until
    the bracket is within rel_tol or max_probes are spent; returns (capacity, every point)."""
    pts = list(points)
    for _ in range(max_probes):
        nxt = bisect_next(pts, rel_tol)
        if nxt is None:
            break
        pts.append((nxt, bool(evaluate(nxt))))
    return capacity(pts), sorted(pts)


# --------------------------------------------------------------------------- all runs


def bracket(points: Iterable[tuple[float, bool]]) -> dict[str, float | None]:
    """{met, failed}: the highest APS meeting the SLO (every lower probe meeting it too) and the
    lowest failed APS above it (None where there is none: a lower bound only)."""
    best, fails = _fails_above_capacity(sorted(points))
    return {"met": best, "failed": min(fails) if fails else None}


def ratio_interval(num: dict[str, float | None], den: dict[str, float | None]) -> tuple[float, float] | None:
    """What the brackets allow for num's capacity over den's: [num.met / den.failed,
    num.failed / den.met]; None unless both are bracketed."""
    if None in (num.get("met"), num.get("failed"), den.get("met"), den.get("failed")) or not den["met"]:
        return None
    return num["met"] / den["failed"], num["failed"] / den["met"]


def agreement(cur: dict[str, list[dict]]) -> list[str]:
    """The runs where the saturation rule and the SLO disagree, in words (empty: they agree)."""
    out = []
    for m, pts in cur.items():
        for p in pts:
            sat = p["verdict"].get("saturation")
            if sat and p["meets_slo"]:
                out.append(f"{m} at {p['aps']:g} APS met the SLO while {sat}")
            elif not sat and not p["meets_slo"] and p["verdict"].get("storage_busy"):
                out.append(f"{m} at {p['aps']:g} APS failed the SLO ({'; '.join(p['verdict']['reasons'])}) with no "
                           "storage NIC saturated")
    return out


def online_runs(runs: dict[str, Run]) -> list[Run]:
    """The online runs among these (they have an APS), by APS."""
    return sorted((r for r in runs.values() if r.aps is not None), key=lambda r: r.aps)


def curves(runs: dict[str, Run], modes: Sequence[str] = MODES) -> dict[str, list[dict]]:
    """mode -> its points by APS, over every online run that has the mode."""
    out: dict[str, list[dict]] = {m: [] for m in modes}
    for r in online_runs(runs):
        for m in modes:
            if r.has(m):
                out[m].append(point(r, m))
    return out


def capacities(cur: dict[str, list[dict]]) -> dict[str, float | None]:
    return {m: capacity((p["aps"], p["meets_slo"]) for p in pts) for m, pts in cur.items()}


def brackets(cur: dict[str, list[dict]]) -> dict[str, dict[str, float | None]]:
    return {m: bracket((p["aps"], p["meets_slo"]) for p in pts) for m, pts in cur.items()}


def unbracketed(cur: dict[str, list[dict]]) -> list[str]:
    """The modes whose every probed APS met the SLO: their capacity is a lower bound."""
    return [m for m, pts in cur.items() if pts and not bracketed((p["aps"], p["meets_slo"]) for p in pts)]
