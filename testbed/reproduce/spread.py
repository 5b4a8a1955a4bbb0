"""How sure a measured headline is: a 95 % interval over the run's own units, or over seeds.

- per-window headlines (figures 13 and 14): `loaded_mean`, a bootstrap over the loaded windows;
- one number per seed: `t_interval`;
- a JCT, or a ratio of JCTs (every speed-up): `jct_draws` and `ratio_draws`, a bootstrap over the
  agents. An offline JCT is the last agent's finish, so each resample of the agents (with
  replacement, the same agents in both runs where the runs share them) has its own JCT, and the
  2,000 resampled values give the interval. The bootstrap of a maximum is biased low: the interval
  says how much the headline rests on which agents the workload drew, not what another seed
  would give (`--seeds` and `t_interval` say that).
Every bootstrap is seeded, so a report made twice from the same runs says the same.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:
    from testbed.measure.runs import Run

REPS = 2000
JCT_METHOD = "bootstrap over agents (2,000 resamples): each resample's JCT is its last agent's finish"
PAIRED_METHOD = ("paired bootstrap over agents (2,000 resamples, the same agents in both runs): each resample's "
                 "JCT is its last agent's finish (its mean agent JCT, for a mean)")


@dataclass(frozen=True)
class Estimate:
    """A measured value with its sample count and 95 % interval."""

    value: float | None
    n: int
    ci95: tuple[float, float] | None
    method: str


def bootstrap_ci(xs: Sequence[float], reps: int = REPS, seed: int = 0) -> tuple[float, float] | None:
    """95 % percentile-bootstrap interval of the mean (None below two samples)."""
    return sample_draws(xs, "samples", seed=seed, reps=reps).estimate().ci95


# Student-t 97.5 % quantiles for 1..30 degrees of freedom; the normal's beyond
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_interval(xs: Sequence[float]) -> tuple[float, float] | None:
    """95 % Student-t interval of the mean (None below two samples): for one number per seed."""
    xs = [float(x) for x in xs if x is not None]
    n = len(xs)
    if n < 2:
        return None
    m = sum(xs) / n
    sem = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n)
    q = _T975[n - 2] if n - 1 <= len(_T975) else 1.96
    return m - q * sem, m + q * sem


def loaded_mean(series: Sequence[dict]) -> Estimate:
    """The headline of a per-window series: the mean `value` of its points with `loaded` true, their
    count, and a bootstrap over those windows. Figures 13 and 14 draw exactly these points."""
    xs = [p["value"] for p in series if p.get("loaded") and p.get("value") is not None]
    return Estimate(sum(xs) / len(xs) if xs else None, len(xs), bootstrap_ci(xs),
                    "bootstrap over loaded windows (2,000 resamples)")


NO_INTERVAL = "no interval:"  # how an Estimate's method begins when it says why it has none


@dataclass(frozen=True)
class Draws:
    """A measured value and its bootstrap replicates (None where there is nothing to resample);
    combined element by element, so a mean or a difference of speed-ups gets its interval too."""

    value: float | None
    draws: np.ndarray | None
    n: int
    method: str

    def estimate(self) -> Estimate:
        if self.value is None or self.draws is None:
            return Estimate(self.value, self.n, None, self.method)
        d = self.draws[np.isfinite(self.draws)]
        ci = (float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))) if d.size else None
        if ci is not None and not ci[0] - 1e-12 <= self.value <= ci[1] + 1e-12:
            # A max over a few columns near perfect balance: every resample is less balanced than
            # the run (mooncake-trace's SNIC max/avg 1.007 against [1.009, 1.244]). Such an
            # interval says more about resampling than about the run; it is not shown.
            return Estimate(self.value, self.n, None, f"{NO_INTERVAL} the run's value lies outside the 95 % range "
                            f"[{ci[0]:.4g}, {ci[1]:.4g}] of its resamples ({self.method}); a resampled max is biased")
        return Estimate(self.value, self.n, ci, self.method)


NONE = Draws(None, None, 0, JCT_METHOD)


def ci_text(ci: Sequence[float] | None, fmt: str = "{:.2f}") -> str:
    """' [lo, hi]' for a plot's label, '' without an interval."""
    return f" [{fmt.format(ci[0])}, {fmt.format(ci[1])}]" if ci else ""


# What a resample of the agents is reduced to: per agent a number from its (arrival, finish), the
# reduction, and the run's own value the whole set is scaled to (its clock stops a little before
# the last record is stamped, and its agent JCT counts from the agent's arrival).
STATS = {
    "jct": (lambda a, d: d, np.max, lambda run, m: run.jct(m)),
    "agent_jct": (lambda a, d: d - a, np.mean, lambda run, m: (run.mode(m).get("agent_jct_s") or {}).get("mean")),
}


def _per_agent(run: "Run", mode: str, stat: str) -> dict[Any, float]:
    if not run.has(mode):
        return {}
    f = STATS[stat][0]
    return {k: f(a, d) for k, (a, d) in run.agent_spans_s(mode).items()}


def _resampled(run: "Run", mode: str, stat: str, per: dict[Any, float], agents: Sequence,
               idx: np.ndarray) -> np.ndarray:
    """The statistic of each resample of `agents` (per: their values, _per_agent), scaled so that
    the whole set gives the run's own."""
    _, reduce, own = STATS[stat]
    a = np.asarray([per[x] for x in agents], dtype=float)
    full = float(reduce(a))
    target = own(run, mode)
    scale = target / full if target is not None and full else 1.0
    return scale * reduce(a[idx], axis=1)


def _idx(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(REPS, n))


def _value(run: "Run", mode: str, stat: str) -> float | None:
    if not run.has(mode):
        return None
    v = STATS[stat][2](run, mode)
    if v is None:
        per = list(_per_agent(run, mode, stat).values())
        v = float(STATS[stat][1](np.asarray(per))) if per else None
    return v


def jct_draws(run: "Run", mode: str, seed: int = 0, stat: str = "jct") -> Draws:
    """A mode's JCT (or mean agent JCT), emulated s, with a bootstrap over its agents."""
    per = _per_agent(run, mode, stat)
    agents = sorted(per, key=str)
    value = _value(run, mode, stat)
    if not agents or value is None:
        return Draws(value, None, 0, JCT_METHOD)
    return Draws(value, _resampled(run, mode, stat, per, agents, _idx(len(agents), seed)), len(agents), JCT_METHOD)


def ratio_draws(num: tuple["Run", str], den: tuple["Run", str], seed: int = 0, stat: str = "jct") -> Draws:
    """stat(num) / stat(den) (a speed-up when den is the faster mode), resampling the agents both
    share together, or each run's own agents apart where their agents differ."""
    (rn, mn), (rd, md) = num, den
    vn, vd = _value(rn, mn, stat), _value(rd, md, stat)
    if vn is None or not vd:
        return NONE
    fa, fb = _per_agent(rn, mn, stat), _per_agent(rd, md, stat)
    if not fa or not fb:
        return Draws(vn / vd, None, 0, PAIRED_METHOD)
    if set(fa) == set(fb):
        agents = sorted(fa, key=str)
        idx = _idx(len(agents), seed)
        return Draws(vn / vd, _resampled(rn, mn, stat, fa, agents, idx) / _resampled(rd, md, stat, fb, agents, idx),
                     len(agents), PAIRED_METHOD)
    a, b = sorted(fa, key=str), sorted(fb, key=str)
    d = _resampled(rn, mn, stat, fa, a, _idx(len(a), seed)) / _resampled(rd, md, stat, fb, b, _idx(len(b), seed + 1))
    return Draws(vn / vd, d, min(len(a), len(b)), JCT_METHOD + "; the two runs resampled apart")


def speedup_draws(run: "Run", base: str = "basic", new: str = "dualpath", stat: str = "jct") -> Draws:
    """base's JCT over new's in one run (DualPath's speed-up over Basic by default)."""
    return ratio_draws((run, base), (run, new), stat=stat)


def map_draws(d: Draws, f) -> Draws:
    """f applied to the value and to every replicate (f must work on numpy arrays)."""
    if d.value is None:
        return d
    return Draws(f(d.value), None if d.draws is None else f(d.draws), d.n, d.method)


def mean_draws(ds: Sequence[Draws]) -> Draws:
    """The mean of several values with its replicates, element by element (runs of one workload
    share their agents and seed, so each replicate resamples the same agents in all of them)."""
    ds = [d for d in ds if d.value is not None]
    if not ds:
        return NONE
    value = sum(d.value for d in ds) / len(ds)
    if any(d.draws is None for d in ds):
        return Draws(value, None, min(d.n for d in ds), ds[0].method)
    return Draws(value, np.mean([d.draws for d in ds], axis=0), min(d.n for d in ds), ds[0].method)


def difference_draws(a: Draws, b: Draws) -> Draws:
    """a - b, with its replicates element by element (as mean_draws)."""
    if a.value is None or b.value is None:
        return NONE
    d = a.draws - b.draws if a.draws is not None and b.draws is not None else None
    return Draws(a.value - b.value, d, min(a.n, b.n), a.method)


def _stat(a: np.ndarray, q: float | None, axis: int | None = None):
    return a.mean(axis=axis) if q is None else np.percentile(a, q, axis=axis)


def sample_draws(xs: Sequence[float], what: str, q: float | None = None, seed: int = 0, reps: int = REPS) -> Draws:
    """The mean (q None) or the q-th percentile of xs, with a bootstrap over them; `what` names the
    units (requests, collectives)."""
    x = np.asarray([v for v in xs if v is not None], dtype=float)
    name = "mean" if q is None else f"p{q:g}"
    if not x.size:
        return Draws(None, None, 0, f"bootstrap over {what}")
    draws = _stat(np.random.default_rng(seed).choice(x, size=(reps, x.size)), q, axis=1) if x.size > 1 else None
    return Draws(float(_stat(x, q)), draws, int(x.size), f"bootstrap over {what} (2,000 resamples of the {name})")


def sample_ratio_draws(a: Sequence[float], b: Sequence[float], what: str, q: float | None = None) -> Draws:
    """stat(a) / stat(b), the mean or the q-th percentile, each sample resampled apart (two
    conditions' collectives, two runs' requests)."""
    da, db = sample_draws(a, what, q, seed=0), sample_draws(b, what, q, seed=1)
    if da.value is None or not db.value:
        return Draws(None, None, 0, da.method)
    draws = None
    if da.draws is not None and db.draws is not None:
        draws = da.draws / np.where(db.draws == 0, np.nan, db.draws)
    return Draws(da.value / db.value, draws, min(da.n, db.n), da.method.replace(" (", " (each apart; ", 1))


def sums_draws(units: Sequence[Sequence[float]], stat, value: float | None, what: str, seed: int = 0) -> Draws:
    """A statistic of column sums over units (one row per unit: a request's hit and prompt tokens,
    its bytes per NIC), with a bootstrap over the units; each replicate is scaled so that all the
    units give `value`, the run's own number (its counters, not the units' sums, are the measure).
    `stat` maps an array of column sums (..., k) to the statistic along the last axis."""
    u = np.asarray(units, dtype=float)
    if value is None or u.ndim != 2 or len(u) < 2:
        return Draws(value, None, len(u) if u.ndim == 2 else 0, f"bootstrap over {what}")
    full = float(stat(u.sum(axis=0)))
    idx = np.random.default_rng(seed).integers(0, len(u), size=(REPS, len(u)))
    with np.errstate(divide="ignore", invalid="ignore"):
        draws = stat(u[idx].sum(axis=1)) * (value / full if full else np.nan)
    return Draws(value, draws, len(u), f"bootstrap over {what} (2,000 resamples), scaled to the run's own value")
