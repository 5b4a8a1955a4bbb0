"""Flow-level model of links shared by flows, for the simulator (DESIGN.md section 9).

The model
---------
A `Link` is one direction of one emulated NIC (the testbed shapes both veth ends, so a NIC's tx
and rx are separate links), with a capacity in bit/s. A `Flow` moves a byte count over a path of
links; in the simulator one flow is one hop of `dualpath.accounting` (src NIC tx, dst NIC rx).
Between two events (a flow activates or completes) every flow moves at a constant rate, so
progress is exact and piecewise linear; rates are recomputed only at events.

Rates are a fluid equilibrium of what the testbed's HTB configuration (emulators/nic.py) and TCP
converge to:

* **QoS off, or a FIFO link** (SNICs, storage NICs; CNICs and host ports with `qos: off`): one
  class. All flows share max-min fairly (progressive filling / water-filling over multi-hop
  paths): each flow is limited by a saturated link on which no flow is faster.
* **QoS on** (CNICs and host ports): HTB under the root class (rate = ceil = link) has two leaves,
  model (prio 0, rate 240/255 of the link) and kv (prio 1, rate 15/255), both with ceil = link.
  A rate is a guarantee, not a reservation, and spare bandwidth goes to the lower prio number
  first. In the fluid limit, on a link where both classes have flows:
    - kv keeps min(its demand, 15/255 C) (its HTB rate);
    - model gets the rest it can use, C - min(kv, 15/255 C): 240/255 C when kv wants its
      guarantee, more when kv is held below it elsewhere, all of C when no kv flow is there;
    - kv takes whatever model leaves idle (borrowing up to its ceil);
    - within a class, max-min fairness as above.
  Where only one class has flows, that class may take the whole link (ceil = link).
  The guarantee fractions are the classes' weights in `dualpath.traffic_classes` (the same ones
  nic.py turns into HTB rates), so they cannot drift apart.

Because a kv flow's demand on one link depends on what it gets on its other links, and model's
share of a link depends on that demand, the QoS allocation is a fixed point. On each contested
link (QoS on, both classes present) the fill has one constraint per class instead of the joint
one, model <= C - min(g, kv) and kv <= max(g, C - model) with g = 15/255 C; one max-min fill over
all links gives the class totals, and those the next caps. Every fixed point is feasible and is
HTB's equilibrium: each flow has a full link on its path where it is among the fastest of its
class (of all flows, on a one-class link) and HTB would give its class no more there (for a
model flow kv holds at most its guarantee, for a kv flow at least). The search starts from kv
held to its guarantee and model to the rest. The map is piecewise affine; Anderson acceleration
(falling back to the averaged map (x + T(x)) / 2 when the residual stops falling, and striding
along pieces where the map only shifts its argument) settles it in one or two fills where the
classes meet on one link, and in at most about 20 over some 50,000 dense random meshes with mixed
classes on FIFO links. Should it not settle within
MAX_FIXED_POINT_ITERATIONS fills it warns and adds the joint link constraint to the last fill, so
no link is ever over capacity.

Assumptions
-----------
* Fluid, TCP-like sharing that converges instantly: no slow start, no congestion-window or RTT
  effects, no packets. A new flow gets its share at once.
* Lossless fabrics, as DualPath runs on (InfiniBand credits; the testbed's deep HTB queues): no
  drops, no retransmissions, no goodput loss under overload.
* A flow is elastic up to its bottleneck: nothing but the links limits it.
* An optional fixed per-transfer overhead (seconds before the flow's bytes start to move) stands
  for setup and latency. It defaults to 0 and is meant to be fitted from testbed runs.

Not modelled
------------
Propagation delay and store-and-forward within a path (a path's links carry a flow at the same
instant), HTB quantum and rate granularity (tc floors class rates to whole bit/s, at least
8000 bit/s; the model keeps exact fractions), HTB's burst (the cluster simulation adds it: an idle
shaped link's bucket, simulator/cluster.py `_burst`), per-flow unfairness of real TCP (RTT bias, BBR
probing), finite buffers and back-pressure, sender CPU or DRAM limits other than what a link
stands for (the host port stands for the DRAM side), and the UDP-flood style loss that only
non-backing-off traffic shows.

Numerics
--------
Completion is exact: a flow completes at the event time its own rate predicts, its remaining
bytes are set to 0 and accounted, so per-link byte totals equal the bytes of the flows that
crossed them. Flows within a relative `BYTES_RTOL` of the end at an event complete with it, so
flows that finish "together" complete in one event instead of a cascade of tiny steps; every
event completes or activates at least one flow, so there is no zero-progress livelock. Rates are
never negative and never exceed a link's capacity (beyond a relative 1e-11 of rounding).
"""
from __future__ import annotations

import heapq
import itertools
import math
import warnings
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Callable, Hashable, Iterable, Sequence

import numpy as np

from dualpath.traffic_classes import CLASSES, KV, MODEL, TrafficClass, by_name

# The high class is the one HTB serves first (lower prio); the other is the best-effort class.
HIGH, LOW = sorted(CLASSES, key=lambda tc: tc.htb_prio)
if (HIGH, LOW) != (MODEL, KV):
    raise ImportError("the flow model assumes two traffic classes, model served before kv")
CLASS_NAMES = (MODEL.name, KV.name)

BYTES_RTOL = 1e-9  # a flow this close to its end (relative to its size) completes with an event
BYTES_ATOL = 1e-6  # ... or this many bytes, for tiny flows
RATE_RTOL = 1e-12  # link-relative: residual capacity below this is saturated
TIME_RTOL = 1e-12  # event times this close (relative, at least 1 s scale) are the same instant
MAX_FIXED_POINT_ITERATIONS = 200
ANDERSON_MEMORY = 8


def guaranteed_fraction(tc: TrafficClass | str) -> float:
    """Share of a busy QoS link that HTB guarantees to a class (its `rate` in nic.py)."""
    tc = _class(tc)
    return tc.weight / sum(c.weight for c in CLASSES)


def _class(tc: TrafficClass | str) -> TrafficClass:
    return tc if isinstance(tc, TrafficClass) else by_name(tc)


def _time_tol(t: float) -> float:
    return TIME_RTOL * max(1.0, abs(t))


@dataclass(frozen=True, eq=False)
class Link:
    """One direction of one NIC. Identity is the object: two links never merge by name."""

    name: str
    capacity_bps: float
    qos: bool = True  # the two HTB classes (CNIC, host port with QoS on) or one FIFO class

    def __post_init__(self):
        if not (isinstance(self.capacity_bps, Real) and math.isfinite(self.capacity_bps)
                and self.capacity_bps > 0):
            raise ValueError(f"link {self.name!r}: capacity must be a positive finite bit/s, "
                             f"got {self.capacity_bps!r}")

    @property
    def kv_guarantee_bps(self) -> float:
        """What HTB guarantees the kv class on this link when QoS is on (15/255 of it)."""
        return self.capacity_bps * guaranteed_fraction(LOW)

    def __repr__(self) -> str:
        return f"Link({self.name!r}, {self.capacity_bps:g}, qos={self.qos})"


@dataclass(eq=False)
class Flow:
    """`bytes` to move over `path`, in `traffic_class`, submitted at `start` (seconds).

    State kept by a FlowNetwork: `active_at` (start plus overhead), `remaining` bytes, the current
    `rate_bps`, and `finish` once complete.
    """

    id: Hashable
    path: tuple[Link, ...]
    bytes: float
    traffic_class: str = KV.name
    start: float = 0.0
    active_at: float | None = field(default=None, init=False)
    remaining: float = field(default=0.0, init=False)
    rate_bps: float = field(default=0.0, init=False)
    finish: float | None = field(default=None, init=False)
    _eta: float = field(default=math.inf, init=False, repr=False)

    def __post_init__(self):
        self.path = tuple(self.path)
        if not self.path or not all(isinstance(l, Link) for l in self.path):
            raise ValueError(f"flow {self.id!r}: path must be a non-empty sequence of Links")
        if len(set(map(id, self.path))) != len(self.path):
            raise ValueError(f"flow {self.id!r}: path crosses a link twice")
        if not (isinstance(self.bytes, Real) and math.isfinite(self.bytes) and self.bytes >= 0):
            raise ValueError(f"flow {self.id!r}: bytes must be a finite number >= 0, got {self.bytes!r}")
        self.traffic_class = _class(self.traffic_class).name
        if not math.isfinite(self.start):
            raise ValueError(f"flow {self.id!r}: start must be finite")
        self.remaining = float(self.bytes)

    @property
    def done(self) -> bool:
        return self.finish is not None


# --------------------------------------------------------------------------- rate allocation


def _fill(n: int, constraints: Sequence[tuple[Sequence[int], float, float]]) -> list[float]:
    """Progressive filling: rates of flows 0..n-1 under constraints (members, cap, scale).

    All unfrozen flows share one rising level; when a constraint's residual reaches 0 (within
    RATE_RTOL * scale) its unfrozen members freeze at the level. Every flow must be a member of
    some constraint. Rates come out as (cap - frozen members) / count of the bottleneck, not as a
    sum of increments.
    """
    rate = [0.0] * n
    frozen = [False] * n
    of_flow: list[list[int]] = [[] for _ in range(n)]
    members = [list(m) for m, _, _ in constraints]
    caps = [max(0.0, float(c)) for _, c, _ in constraints]
    tol = [RATE_RTOL * s for _, _, s in constraints]
    for c, m in enumerate(members):
        for f in m:
            of_flow[f].append(c)
    if any(not cs for cs in of_flow):
        raise ValueError("every flow needs a constraint")
    used = [0.0] * len(caps)
    count = [len(m) for m in members]
    live = {c for c in range(len(caps)) if count[c]}
    level, left = 0.0, n
    while left:
        best_c = min(live, key=lambda c: ((caps[c] - used[c]) / count[c], c))
        level = max(level, (caps[best_c] - used[best_c]) / count[best_c])
        saturated = [c for c in live if c == best_c or caps[c] - used[c] - count[c] * level <= tol[c]]
        for c in saturated:
            for f in members[c]:
                if frozen[f]:
                    continue
                frozen[f], rate[f] = True, level
                left -= 1
                for c2 in of_flow[f]:
                    used[c2] += level
                    count[c2] -= 1
                    if not count[c2]:
                        live.discard(c2)
    return rate


def max_min_rates(flows: Iterable[Flow]) -> dict[Flow, float]:
    """Rate (bit/s) of each flow, all active at once: max-min per class, HTB priority on QoS links."""
    flows = list(flows)
    if not flows:
        return {}
    index = {f: i for i, f in enumerate(flows)}
    on_link: dict[Link, list[int]] = {}
    for f in flows:
        for l in f.path:
            on_link.setdefault(l, []).append(index[f])
    high = {i for i, f in enumerate(flows) if f.traffic_class == HIGH.name}
    shared = []  # every link with one class, FIFO links: all flows <= C
    contested = []  # QoS links carrying both classes: (link, model members, kv members)
    for l, m in on_link.items():
        mh = [i for i in m if i in high]
        if l.qos and mh and len(mh) < len(m):
            contested.append((l, mh, [i for i in m if i not in high]))
        else:
            shared.append((m, l.capacity_bps, l.capacity_bps))
    if not contested:
        rates = _fill(len(flows), shared)
        return {f: rates[i] for f, i in index.items()}

    # A contested link has one constraint per class instead of a joint one (a joint constraint
    # would let kv share with model at equal priority): model <= C - min(guarantee, kv) and
    # kv <= max(guarantee, C - model). Their fixed points are exactly HTB's allocation (see the
    # module docstring). Start from kv held to its guarantee, model to the rest.
    cap_c = np.array([l.capacity_bps for l, _, _ in contested])
    guar = np.array([l.kv_guarantee_bps for l, _, _ in contested])
    lo, hi = np.concatenate([cap_c - guar, guar]), np.concatenate([cap_c, cap_c])
    tol = 16 * RATE_RTOL * np.concatenate([cap_c, cap_c])

    def fill(x, joint=False):
        cons = list(shared)
        for j, (l, mh, ml) in enumerate(contested):
            cons += [(mh, x[j], l.capacity_bps), (ml, x[len(contested) + j], l.capacity_bps)]
            if joint:
                cons.append((mh + ml, l.capacity_bps, l.capacity_bps))
        return _fill(len(flows), cons)

    def step(x):
        rates = fill(x)
        model = np.array([sum(rates[i] for i in mh) for _, mh, _ in contested])
        kv = np.array([sum(rates[i] for i in ml) for _, _, ml in contested])
        return rates, np.concatenate([cap_c - np.minimum(guar, kv), np.maximum(guar, cap_c - model)])

    x, rates = _fixed_point(step, lo.copy(), lo, hi, tol)  # from model capped at C - guarantee, kv at it
    if rates is None:
        warnings.warn(f"QoS rate allocation did not settle in {MAX_FIXED_POINT_ITERATIONS} fills "
                      f"({len(flows)} flows, {len(contested)} contested links); the links' joint "
                      f"capacity is enforced on the last one", RuntimeWarning)
        rates = fill(x, joint=True)
    return {f: rates[i] for f, i in index.items()}


def _fixed_point(step: Callable, x: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                 tol: np.ndarray) -> tuple[np.ndarray, list[float] | None]:
    """Iterate the caps x -> T(x) (`step` gives the rates at x and T(x)) to a fixed point within
    `tol`, with Anderson acceleration; (x, its rates), or (the last x, None) if none was reached
    in MAX_FIXED_POINT_ITERATIONS."""
    xs, gs, last, damp, stride, f_prev = [], [], math.inf, 1.0, 1.0, None
    for _ in range(MAX_FIXED_POINT_ITERATIONS):
        rates, t = step(x)
        f = t - x
        if np.all(np.abs(f) <= tol):
            return x, rates
        norm = float(np.linalg.norm(f))
        if f_prev is not None and np.linalg.norm(f - f_prev) <= 1e-6 * norm:
            # The map only shifts x by a constant (slope 1 along f: kv's cap feeds kv, which
            # takes as much from a model flow on a FIFO link, which raises kv's cap again): no
            # fixed point on this piece, so stride along f, doubling, until the piece ends.
            stride *= 2
            xs, gs, f_prev, last = [], [], f, math.inf
            x = np.clip(x + stride * f, lo, hi)
            continue
        stride, f_prev = 1.0, f
        # Anderson acceleration solves an affine piece of the (piecewise affine) map in a few
        # steps. When the residual stops falling, the extrapolation is dropped and the iteration
        # goes on with the averaged map (x + T(x)) / 2: the same fixed points, and a feedback of
        # slope -1 (a plain iteration's 2-cycle) is solved in one step.
        if norm >= last:
            xs, gs, damp = [], [], 0.5
        last = norm
        g = x + damp * f
        xs, gs = (xs + [x])[-ANDERSON_MEMORY - 1:], (gs + [g])[-ANDERSON_MEMORY - 1:]
        if len(xs) > 1:
            fs = [gi - xi for gi, xi in zip(gs, xs)]
            dF = np.column_stack([fs[i + 1] - fs[i] for i in range(len(fs) - 1)])
            dG = np.column_stack([gs[i + 1] - gs[i] for i in range(len(gs) - 1)])
            gamma = np.linalg.lstsq(dF, fs[-1], rcond=None)[0]
            x = np.clip(g - dG @ gamma, lo, hi)
        else:
            x = g
    return x, None


def link_loads(rates: dict[Flow, float]) -> dict[Link, dict[str, float]]:
    """Per link and class, the bit/s of the given flow rates."""
    out: dict[Link, dict[str, float]] = {}
    for f, r in rates.items():
        for l in f.path:
            d = out.setdefault(l, dict.fromkeys(CLASS_NAMES, 0.0))
            d[f.traffic_class] += r
    return out


# --------------------------------------------------------------------------- event-driven progress


class FlowNetwork:
    """Flows on links, advanced event by event; pure (no SimPy).

    `add` a flow (it activates at start + overhead), `allocate` gives the current rates,
    `next_completion` / `next_event` the next instant anything changes, `advance(dt)` /
    `advance_to(t)` move time, processing every event on the way, and return the flows that
    completed. `delivered[(link, class)]` counts bytes per link and class, like HTB's counters.
    """

    def __init__(self, overhead_s: float = 0.0, now: float = 0.0):
        _check_overhead(overhead_s)
        self.overhead_s = float(overhead_s)
        self.now = float(now)
        self._active: dict[Flow, None] = {}  # insertion-ordered set
        self._pending: list[tuple[float, int, Flow]] = []  # heap by activation time
        self._seq = itertools.count()
        self._ids: set[Hashable] = set()
        self._auto_id = itertools.count()
        self._stale = True
        self._unreported: list[Flow] = []  # completed on activation (zero bytes) inside add
        self.delivered: dict[tuple[Link, str], float] = {}
        self.events = 0  # event steps taken, for tests and cost accounting

    # ---------------------------------------------------------------- flows

    def add(self, flow: Flow, *, overhead_s: float | None = None) -> Flow:
        """Take `flow` in; it moves bytes from start + overhead (at the earliest now)."""
        if flow.done or flow.active_at is not None:
            raise ValueError(f"flow {flow.id!r} was already added to a network")
        if flow.id in self._ids:
            raise ValueError(f"a live flow already has id {flow.id!r}")
        if flow.start < self.now - _time_tol(self.now):
            raise ValueError(f"flow {flow.id!r} starts at {flow.start} before now ({self.now})")
        oh = self.overhead_s if overhead_s is None else _check_overhead(overhead_s)
        flow.active_at = max(self.now, flow.start + oh)
        self._ids.add(flow.id)
        heapq.heappush(self._pending, (flow.active_at, next(self._seq), flow))
        if flow.active_at <= self.now:  # active at once, so that allocate() sees it
            self._unreported += self._activate_due(self.now)
        return flow

    def transfer(self, path: Sequence[Link], nbytes: float, traffic_class: str | TrafficClass = KV.name,
                 *, id: Hashable | None = None, overhead_s: float | None = None) -> Flow:
        """A new flow submitted now."""
        if id is None:
            id = next(i for i in self._auto_id if i not in self._ids)
        return self.add(Flow(id, tuple(path), nbytes, _class(traffic_class).name, self.now),
                        overhead_s=overhead_s)

    @property
    def active(self) -> tuple[Flow, ...]:
        return tuple(self._active)

    @property
    def pending(self) -> tuple[Flow, ...]:
        return tuple(f for _, _, f in sorted(self._pending))

    @property
    def idle(self) -> bool:
        return not self._active and not self._pending and not self._unreported

    # ---------------------------------------------------------------- rates and events

    def allocate(self) -> dict[Hashable, float]:
        """Rate (bit/s) of every active flow, by id; recomputed only after the flow set changed."""
        if self._stale:
            rates = max_min_rates(self._active)
            for f, r in rates.items():
                f.rate_bps = r
                f._eta = self.now + f.remaining * 8 / r if r > 0 else math.inf
            self._stale = False
        return {f.id: f.rate_bps for f in self._active}

    def link_loads(self) -> dict[Link, dict[str, float]]:
        self.allocate()
        return link_loads({f: f.rate_bps for f in self._active})

    def next_completion(self) -> float | None:
        """When the next active flow completes at the current rates (None: none will)."""
        self.allocate()
        t = min((f._eta for f in self._active), default=math.inf)
        return t if t < math.inf else None

    def next_event(self) -> float | None:
        """The next completion or activation, whichever is first (None: nothing will happen)."""
        if self._unreported:
            return self.now  # zero-byte flows completed when added, not yet returned
        c = self.next_completion()
        p = self._pending[0][0] if self._pending else None
        return min((x for x in (c, p) if x is not None), default=None)

    def advance(self, dt: float) -> list[Flow]:
        if not dt >= 0:
            raise ValueError(f"dt must be >= 0, got {dt!r}")
        return self.advance_to(self.now + dt)

    def advance_to(self, t: float) -> list[Flow]:
        """Move time to t, processing every event up to it; the flows completed, in order."""
        if not math.isfinite(t):
            raise ValueError(f"time must be finite, got {t!r}")
        if t < self.now - _time_tol(self.now):
            raise ValueError(f"time goes forward only: now {self.now}, asked {t}")
        done, self._unreported = self._unreported, []
        while True:
            e = self.next_event()
            if e is None or e > t + _time_tol(t):
                break
            done += self._step_to(max(e, self.now))
        if t > self.now:
            self._progress(t - self.now)  # rates unchanged: the predicted instants stand
            self.now = t
        return done

    def run(self, until: float | None = None) -> dict[Hashable, float]:
        """Process events until no flow is left (or `until`); completion time by flow id."""
        out: dict[Hashable, float] = {}
        while not self.idle:
            e = self.next_event()
            if e is None:
                raise RuntimeError(f"stalled at t={self.now}: {len(self._active)} flows with rate 0")
            if until is not None and e > until:
                e = until
            out.update((f.id, f.finish) for f in self.advance_to(e))
            if until is not None and self.now >= until:
                break
        return out

    # ---------------------------------------------------------------- internals

    def _progress(self, dt: float) -> None:
        if dt <= 0:
            return
        self.allocate()
        for f in self._active:
            moved = min(f.remaining, f.rate_bps / 8 * dt)
            f.remaining -= moved
            self._account(f, moved)

    def _account(self, f: Flow, nbytes: float) -> None:
        if nbytes:
            for l in f.path:
                k = (l, f.traffic_class)
                self.delivered[k] = self.delivered.get(k, 0.0) + nbytes

    def _step_to(self, e: float) -> list[Flow]:
        """Advance exactly to event time e (no event before it) and process what happens at e."""
        self.allocate()
        self.events += 1
        dt = e - self.now
        done = []
        for f in list(self._active):
            if f._eta <= e:
                moved = f.remaining  # completes at its own predicted instant: exactly all bytes
            else:
                moved = min(f.remaining, f.rate_bps / 8 * dt) if dt > 0 else 0.0
            f.remaining -= moved
            self._account(f, moved)
            if f._eta <= e or f.remaining <= max(BYTES_RTOL * f.bytes, BYTES_ATOL):
                self._complete(f, e)
                done.append(f)
        self.now = e
        done += self._activate_due(e)
        return done

    def _complete(self, f: Flow, t: float) -> None:
        self._account(f, f.remaining)
        f.remaining, f.rate_bps, f.finish, f._eta = 0.0, 0.0, t, math.inf
        self._active.pop(f, None)
        self._ids.discard(f.id)
        self._stale = True

    def _activate_due(self, t: float) -> list[Flow]:
        done = []
        while self._pending and self._pending[0][0] <= t + _time_tol(t):
            _, _, f = heapq.heappop(self._pending)
            self._stale = True
            if f.bytes <= 0:
                self._complete(f, t)  # within _time_tol of active_at: the event instant
                done.append(f)
            else:
                self._active[f] = None
        return done


def _check_overhead(x: float) -> float:
    if not (isinstance(x, Real) and math.isfinite(x) and x >= 0):
        raise ValueError(f"overhead must be a finite number of seconds >= 0, got {x!r}")
    return float(x)


# --------------------------------------------------------------------------- SimPy adapter


class SimFlowNetwork:
    """A FlowNetwork driven by a SimPy environment.

    `transfer(path, nbytes, traffic_class)` returns an event that succeeds with the Flow when its
    last byte arrives. Rates are recomputed whenever a flow starts or ends; one timer stands for
    the network's next event and is re-armed whenever that instant moves. SimPy cannot unschedule
    a timeout (an interrupted process leaves its timeout queued too), so a superseded timer stays
    queued and does nothing when it fires: at most one such entry per flow start.
    """

    def __init__(self, env, overhead_s: float = 0.0):
        self.env = env
        self.network = FlowNetwork(overhead_s=overhead_s, now=env.now)
        self._events: dict[Flow, Any] = {}
        self._armed_at: float | None = None
        self._generation = 0

    def transfer(self, path: Sequence[Link], nbytes: float, traffic_class: str | TrafficClass = KV.name,
                 *, id: Hashable | None = None, overhead_s: float | None = None):
        self._sync()
        flow = self.network.transfer(path, nbytes, traffic_class, id=id, overhead_s=overhead_s)
        ev = self.env.event()
        self._events[flow] = ev
        self._sync()  # a zero-byte transfer without overhead completes now
        self._rearm()
        return ev

    def _finish(self, flow: Flow) -> None:
        self._events.pop(flow).succeed(flow)

    def _sync(self) -> None:
        for f in self.network.advance_to(max(self.env.now, self.network.now)):
            self._finish(f)

    def _rearm(self) -> None:
        t = self.network.next_event()
        if t == self._armed_at:
            return
        self._generation += 1
        self._armed_at = t
        if t is None:
            return
        gen = self._generation
        timer = self.env.timeout(max(0.0, t - self.env.now))
        timer.callbacks.append(lambda _ev: self._fire(gen))

    def _fire(self, gen: int) -> None:
        if gen != self._generation:
            return  # superseded: the flow set changed after it was armed
        self._armed_at = None
        self._sync()
        self._rearm()
