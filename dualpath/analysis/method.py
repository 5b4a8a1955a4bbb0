"""The paper's bottleneck-free P/D method (DualPath section 4.2), over any set of resources.

The method, as shared/reference/dualpath-article-zh.txt section 3 re-derives it (erratum included):
every storage NIC (SNIC) reads at its full rate sigma = s*B; only hit KV counts (miss KV, decode
write-back and model traffic are left out); what each side reads spreads evenly over that side's
nodes and engines. A resource r then carries, per second,

    load_r = a_r * P * sigma + b_r * D * sigma

where a_r (b_r) is how many times it carries a hit byte read on the PE (DE) path, and it has
members * rate_r of capacity: n_r per prefill node (side "pe"), per decode node ("de"), per node of
either role ("all": the SNICs themselves), or n_r in the whole cluster ("cluster": the storage
servers' NICs). Its utilisation is u_r = load_r / capacity_r, and "bottleneck-free" means every
u_r <= 1. With x = P/D > 0 each condition is linear in x once the positive denominator is
multiplied out:

    "pe":  sigma*(a + b/x) <= n*rho          <=>  (sigma*a - n*rho)*x + sigma*b <= 0
    "de":  sigma*(a*x + b) <= n*rho          <=>  sigma*a*x + (sigma*b - n*rho) <= 0
    "all": sigma*(a*x + b) <= n*rho*(x + 1)  <=>  (sigma*a - n*rho)*x + (sigma*b - n*rho) <= 0

so c1*x + c0 <= 0 is an upper bound on P/D (c1 > 0), a lower bound (c1 < 0), or, when c1 = 0, a
condition that holds or fails whatever P/D is (the erratum's s <= g/2 is one). A "cluster"
resource bounds a*P + b*D, the cluster's size, not its ratio, and is reported apart.

The resource that saturates first at (P, D) is the one with the highest u: scale every flow down
until the first resource reaches its rate and that one is it. Inside the range that is the SNICs
(u = 1, and nothing above), which is the paper's premise. Everything here is pure arithmetic.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

SIDES = ("pe", "de", "all", "cluster")
TOLERANCE = 1e-9  # relative: u within this of 1 counts as exactly at the rate


@dataclass(frozen=True)
class Resource:
    """One kind of rate-limited thing the hit KV crosses, e.g. every decode node's host port tx."""

    name: str  # e.g. "DE host port tx"
    side: str  # one of SIDES: whose nodes have it
    members: float  # per node of that side (g for per-engine NICs, 1 per node); "cluster": in all
    rate: float  # each member's rate, in the same unit as the SNIC rate
    pe_path: float  # hit bytes it carries per hit byte read on the PE path (a)
    de_path: float  # ... per hit byte read on the DE path (b)

    def __post_init__(self) -> None:
        if self.side not in SIDES:
            raise ValueError(f"resource {self.name!r}: side {self.side!r} is not one of {SIDES}")
        for field in ("members", "rate"):
            v = getattr(self, field)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"resource {self.name!r}: {field} must be finite and > 0, got {v!r}")
        for field in ("pe_path", "de_path"):
            v = getattr(self, field)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"resource {self.name!r}: {field} must be finite and >= 0, got {v!r}")

    def capacity(self, p: float, d: float) -> float:
        count = {"pe": p, "de": d, "all": p + d, "cluster": 1.0}[self.side]
        return count * self.members * self.rate

    def utilization(self, p: float, d: float, snic_rate: float) -> float:
        """Its load over its capacity when every SNIC of P + D nodes reads at snic_rate."""
        return snic_rate * (self.pe_path * p + self.de_path * d) / self.capacity(p, d)


@dataclass(frozen=True)
class Model:
    """A set of resources and the SNIC rate that drives them (sigma = s*B)."""

    name: str  # "paper" or "testbed"
    snic_rate: float
    resources: tuple[Resource, ...]
    snic: str  # the resource that stands for the SNICs themselves (u = 1 by the premise)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.snic_rate) and self.snic_rate > 0):
            raise ValueError(f"model {self.name}: the SNIC rate must be finite and > 0, got {self.snic_rate!r}")
        names = [r.name for r in self.resources]
        if len(set(names)) != len(names):
            raise ValueError(f"model {self.name}: resource names repeat: {names}")
        if self.snic not in names:
            raise ValueError(f"model {self.name}: the SNIC resource {self.snic!r} is not among {names}")

    def resource(self, name: str) -> Resource:
        for r in self.resources:
            if r.name == name:
                return r
        raise KeyError(f"model {self.name} has no resource {name!r}")


@dataclass(frozen=True)
class Bound:
    """One resource's condition on P/D: a lower or upper bound, or one that does not depend on it."""

    resource: str
    kind: str  # "lower", "upper", "always" (holds whatever P/D is), "never" (fails whatever P/D is)
    value: float | None = None  # the bound on P/D for "lower"/"upper"


@dataclass(frozen=True)
class ClusterLimit:
    """A cluster-wide resource's condition on the cluster's size: a*P + b*D <= cap."""

    resource: str
    pe_weight: float
    de_weight: float
    cap: float

    def holds(self, p: float, d: float) -> bool:
        return self.pe_weight * p + self.de_weight * d <= self.cap * (1 + TOLERANCE)

    def describe(self) -> str:
        if self.pe_weight == self.de_weight:
            return f"{self.resource}: P+D <= {self.cap / self.pe_weight:.3g}"
        return f"{self.resource}: {self.pe_weight:g}P + {self.de_weight:g}D <= {self.cap:.3g}"


@dataclass(frozen=True)
class PDRange:
    """The bottleneck-free range of P/D: lower <= P/D <= upper, set by the named resources."""

    lower: float
    upper: float
    lower_by: tuple[str, ...]  # the resources whose bound is the lower one (ties: all of them)
    upper_by: tuple[str, ...]
    bounds: tuple[Bound, ...]  # every resource's own condition
    cluster_limits: tuple[ClusterLimit, ...]

    @property
    def feasible(self) -> bool:
        """Some P/D keeps every per-node resource under its rate."""
        return self.lower <= self.upper

    def contains(self, ratio: float) -> bool:
        return self.lower * (1 - TOLERANCE) <= ratio <= self.upper * (1 + TOLERANCE)

    @property
    def failing(self) -> tuple[str, ...]:
        """Resources that are over their rate whatever P/D is."""
        return tuple(b.resource for b in self.bounds if b.kind == "never")


def bound(r: Resource, snic_rate: float) -> Bound | None:
    """r's condition on x = P/D (None for a cluster-wide resource: see cluster_limit)."""
    nr = r.members * r.rate
    a, b = snic_rate * r.pe_path, snic_rate * r.de_path
    if r.side == "pe":
        c1, c0 = a - nr, b
    elif r.side == "de":
        c1, c0 = a, b - nr
    elif r.side == "all":
        c1, c0 = a - nr, b - nr
    else:
        return None
    scale = max(abs(a), abs(b), nr)
    if abs(c1) <= TOLERANCE * scale:  # the condition does not involve P/D
        return Bound(r.name, "always" if c0 <= TOLERANCE * scale else "never")
    x = -c0 / c1
    if c1 > 0:  # c1*x + c0 <= 0  <=>  x <= -c0/c1
        return Bound(r.name, "upper", x) if x > 0 else Bound(r.name, "never")
    return Bound(r.name, "lower", x) if x > 0 else Bound(r.name, "always")


def cluster_limit(r: Resource, snic_rate: float) -> ClusterLimit | None:
    if r.side != "cluster" or (r.pe_path == 0 and r.de_path == 0):
        return None
    return ClusterLimit(r.name, r.pe_path, r.de_path, r.members * r.rate / snic_rate)


def pd_range(model: Model) -> PDRange:
    """The bottleneck-free range of P/D of a model (see the module docstring)."""
    bounds = tuple(b for r in model.resources if (b := bound(r, model.snic_rate)) is not None)
    lows = [b for b in bounds if b.kind == "lower"]
    highs = [b for b in bounds if b.kind == "upper"]
    lower = max((b.value for b in lows), default=0.0)
    upper = min((b.value for b in highs), default=math.inf)
    if any(b.kind == "never" for b in bounds):
        lower, upper = math.inf, -math.inf
    lower_by = tuple(b.resource for b in lows if _close(b.value, lower))
    upper_by = tuple(b.resource for b in highs if _close(b.value, upper))
    limits = tuple(c for r in model.resources if (c := cluster_limit(r, model.snic_rate)) is not None)
    return PDRange(lower, upper, lower_by, upper_by, bounds, limits)


def utilizations(model: Model, p: float, d: float) -> dict[str, float]:
    """Every resource's utilisation at P prefill and D decode nodes with every SNIC at its rate
    (values above 1 mean the premise cannot hold: that resource would saturate first)."""
    _check_pd(p, d)
    return {r.name: r.utilization(p, d, model.snic_rate) for r in model.resources}


def first_saturating(model: Model, p: float, d: float) -> str:
    """The resource that reaches its rate first as every flow grows together: the highest
    utilisation, the SNICs on a tie (the premise: at the range's edge both saturate together)."""
    u = utilizations(model, p, d)
    top = max(u.values())
    if u[model.snic] >= top * (1 - TOLERANCE):
        return model.snic
    return max(u, key=u.get)


def co_saturating(model: Model, p: float, d: float) -> tuple[str, ...]:
    """Every resource tied for the highest utilisation (more than one at a range's edge)."""
    u = utilizations(model, p, d)
    top = max(u.values())
    return tuple(n for n, v in u.items() if v >= top * (1 - TOLERANCE))


def expected_shares(model: Model, p: float, d: float) -> dict[str, float]:
    """What share of its rate each resource carries once the first one saturates and throttles
    every flow alike (the SNICs' split between the paths kept): u_r / max(1, max u)."""
    u = utilizations(model, p, d)
    top = max(1.0, max(u.values()))
    return {n: v / top for n, v in u.items()}


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(abs(a), abs(b), 1.0)


def _check_pd(p: float, d: float) -> None:
    for name, v in (("P", p), ("D", d)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a positive number of nodes, got {v!r}")


def format_range(rng: PDRange) -> str:
    """'1/7 <= P/D <= 6 (lower: PE CNIC rx; upper: DE host port tx)' or why there is none."""
    if rng.failing:
        return f"no bottleneck-free P/D: {', '.join(rng.failing)} over its rate whatever P/D is"
    if not rng.feasible:
        return (f"no bottleneck-free P/D: the lower bound {ratio_str(rng.lower)} ({', '.join(rng.lower_by)}) "
                f"exceeds the upper {ratio_str(rng.upper)} ({', '.join(rng.upper_by)})")
    lo = f"{ratio_str(rng.lower)} <= " if rng.lower > 0 else ""
    hi = f" <= {ratio_str(rng.upper)}" if math.isfinite(rng.upper) else ""
    by = "; ".join(x for x in (f"lower: {', '.join(rng.lower_by)}" if rng.lower_by else "",
                               f"upper: {', '.join(rng.upper_by)}" if rng.upper_by else "") if x)
    return f"{lo}P/D{hi}" + (f" ({by})" if by else "")


def ratio_str(x: float) -> str:
    """A ratio as an integer or a small fraction when it is one (6, 1/7, 7/2), else 3 significant digits."""
    if not math.isfinite(x):
        return "inf" if x > 0 else "-inf"
    if x > 0 and abs(round(x) - x) <= 1e-9 * x:
        return f"{round(x)}"
    for den in range(2, 9):  # small fractions only: 1/7 and 7/2 read better than 0.143 and 3.5
        num = round(x * den)
        if 0 < num <= 12 and abs(num / den - x) <= 1e-9 * max(1.0, x):
            return f"{num}/{den}"
    return f"{x:.3g}"


def table(model: Model, points: Iterable[tuple[int, int]]) -> list[dict]:
    """Per (P, D): inside the P/D range or not, whether the cluster-wide resources (storage
    NICs) keep up at that size, the predicted first-saturating resource, and every resource's
    utilisation under the premise."""
    rng = pd_range(model)
    out = []
    for p, d in points:
        out.append({"p": p, "d": d, "ratio": p / d, "inside": rng.contains(p / d),
                    "cluster_ok": all(c.holds(p, d) for c in rng.cluster_limits),
                    "predicted": first_saturating(model, p, d), "utilization": utilizations(model, p, d)})
    return out

