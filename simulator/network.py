"""The flow model of flows.py, advanced lazily for clusters of a thousand engines.

`flows.FlowNetwork` recomputes every active flow's rate and moves every flow's bytes at every
event: right for tests and small clusters, and O(flows x links) per event. At 48P96D a run has
hundreds of thousands of requests, each a handful of flows, and a thousand flows active at once,
so this network keeps the same model and the same rate function (`flows.max_min_rates`, max-min
per class with HTB's priority) and changes only the bookkeeping:

* **Components.** Max-min rates of flows that share no link are independent. A change (a flow
  starts or ends) recomputes only the connected component of the flows it touches: flows joined
  by links, found by a walk from the changed links.
* **Slack links.** A link that cannot be full whatever the other flows do does not constrain
  anything, so it neither joins components nor enters the rate function: every flow on it is
  bounded by the smallest capacity among its own other links, and when those bounds add up to at
  most the link's capacity the link is slack. Each flow keeps the smallest capacity of its slack
  links as a cap of its own (a private one-flow link), so the rates without the slack links are
  a relaxation of the full problem whose solution fits under every slack link: the same max-min
  rates. A host port of g x B carrying at most g flows that
  each cross a B CNIC is slack, which is what keeps a PE's reads from tying every node together.
  A flow whose links are all slack runs at its smallest capacity.
* **Lazy progress.** A flow keeps (remaining bytes, rate, since when); its bytes are settled only
  when its rate changes or it completes, and completions come from a heap with stale entries
  skipped. An event costs the size of the component it touches, not of the network.

Flows are one-shot: `start` a transfer now, learn its completion from `advance_to` (or, under
SimPy, from the event `SimNetwork.transfer` returns). Completion is exact (a flow completes at the
instant its rate predicts) and flows ending within TIME_RTOL of an event end with it, as in
flows.py. Bytes are counted per link when a flow completes (`delivered`).
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Hashable, Sequence
from typing import Any

from dualpath.traffic_classes import KV, TrafficClass

from .flows import Link, _class, max_min_rates

TIME_RTOL = 1e-12  # events this close (relative, at least 1 s scale) are one instant
RATE_RTOL = 1e-12  # link-relative: residual capacity below this is full (as flows.RATE_RTOL)


def _tol(t: float) -> float:
    return TIME_RTOL * max(1.0, abs(t))


class NetFlow:
    """A transfer in a FastFlowNetwork (its own state; compare flows.Flow)."""

    __slots__ = ("id", "path", "bytes", "traffic_class", "start", "remaining", "rate_bps", "since",
                 "eta", "finish", "_version", "_proxy", "_cap", "callback", "ubs", "min_cap")

    def __init__(self, id: Hashable, path: tuple[Link, ...], nbytes: float, traffic_class: str, start: float):
        self.id, self.path, self.bytes, self.traffic_class, self.start = id, path, float(nbytes), traffic_class, start
        self.remaining = float(nbytes)
        self.rate_bps = 0.0
        self.since = start
        self.eta = math.inf
        self.finish: float | None = None
        self._version = 0
        self._proxy: Any = None
        self._cap: Link | None = None
        self.callback = None
        caps = [l.capacity_bps for l in path]
        self.min_cap = min(caps)
        # per link of the path: the flow's bound there, the smallest capacity of its other links
        self.ubs = tuple(min((c for j, c in enumerate(caps) if j != i), default=math.inf) for i in range(len(caps)))

    def _cap_link(self, cap: float) -> Link:
        if self._cap is None or self._cap.capacity_bps != cap:
            self._cap = Link(f"cap:{self.id}", cap, qos=False)
        return self._cap

    @property
    def done(self) -> bool:
        return self.finish is not None

    def __repr__(self) -> str:
        return f"NetFlow({self.id!r}, {self.bytes:g} B, rate {self.rate_bps:g})"


class _Proxy:
    """What max_min_rates sees of a flow: its binding links only."""

    __slots__ = ("path", "traffic_class")

    def __init__(self, path: tuple[Link, ...], traffic_class: str):
        self.path, self.traffic_class = path, traffic_class


class FastFlowNetwork:
    """Flows on links, rates by flows.max_min_rates per component; see the module docstring."""

    def __init__(self, now: float = 0.0):
        self.now = float(now)
        self._on: dict[Link, dict[NetFlow, None]] = {}  # link -> its active flows (ordered set)
        self._ls: dict[Link, list] = {}  # link -> [flows, sum of their bounds] (the slack test)
        self._heap: list[tuple[float, int, int, NetFlow]] = []
        self._seq = itertools.count()
        self._dirty: set[Link] = set()  # links whose flow set changed since the last allocation
        self._ids = itertools.count()
        self.active = 0
        self.delivered: dict[Link, float] = {}  # bytes per link, counted when a flow completes
        self.events = 0
        self.allocations = 0  # rate-function calls (components recomputed)
        self.allocated_flows = 0  # flows those calls covered

    # ---------------------------------------------------------------- flows in
    def start(self, path: Sequence[Link], nbytes: float, traffic_class: str | TrafficClass = KV.name,
              id: Hashable | None = None) -> NetFlow:
        """A flow of `nbytes` over `path`, moving from now on."""
        path = tuple(path)
        if not path:
            raise ValueError("a flow needs at least one link")
        if len(set(map(id_of, path))) != len(path):
            raise ValueError("a flow's path crosses a link twice")
        if not (math.isfinite(nbytes) and nbytes >= 0):
            raise ValueError(f"bytes must be finite and >= 0, got {nbytes!r}")
        f = NetFlow(next(self._ids) if id is None else id, path, nbytes, _class(traffic_class).name, self.now)
        if f.bytes <= 0:
            f.finish = self.now
            return f
        for l, ub in zip(path, f.ubs):
            self._on.setdefault(l, {})[f] = None
            st = self._ls.get(l)
            if st is None:
                self._ls[l] = [1, ub]
            else:
                st[0] += 1
                st[1] += ub
            self._dirty.add(l)
        self.active += 1
        return f

    # ---------------------------------------------------------------- time
    def next_event(self) -> float | None:
        """When the next flow completes at the current rates (None: nothing will)."""
        self._allocate()
        heap = self._heap
        while heap:
            eta, _, ver, f = heap[0]
            if f.finish is None and ver == f._version:
                return eta
            heapq.heappop(heap)
        return None

    def advance_to(self, t: float) -> list[NetFlow]:
        """Move time to t, completing every flow due on the way (in time order)."""
        if t < self.now - _tol(self.now):
            raise ValueError(f"time goes forward only: now {self.now}, asked {t}")
        done: list[NetFlow] = []
        while True:
            e = self.next_event()
            if e is None or e > t + _tol(t):
                break
            done += self._complete_due(max(e, self.now))
        self.now = max(self.now, t)
        return done

    def _complete_due(self, e: float) -> list[NetFlow]:
        self.events += 1
        self.now = e
        heap, out = self._heap, []
        lim = e + _tol(e)
        while heap:
            eta, _, ver, f = heap[0]
            if f.finish is not None or ver != f._version:
                heapq.heappop(heap)
                continue
            if eta > lim:
                break
            heapq.heappop(heap)
            self._finish(f, e)
            out.append(f)
        return out

    def _finish(self, f: NetFlow, t: float) -> None:
        f.remaining, f.rate_bps, f.finish, f.eta = 0.0, 0.0, t, math.inf
        f._version += 1
        self.active -= 1
        for l, ub in zip(f.path, f.ubs):
            on = self._on[l]
            del on[f]
            st = self._ls[l]
            if not on:
                del self._on[l]
                del self._ls[l]
            else:  # recount rather than subtract: inf - inf, and rounding, never accumulate
                st[0] -= 1
                st[1] = math.fsum(g.ubs[g.path.index(l)] for g in on) if st[0] < 64 or ub == math.inf \
                    else st[1] - ub
            self._dirty.add(l)
            self.delivered[l] = self.delivered.get(l, 0.0) + f.bytes

    # ---------------------------------------------------------------- rates
    def _slack(self, l: Link) -> bool:
        """True when the flows on l cannot fill it (see the module docstring): the bounds of its
        flows (each the smallest capacity of its other links) add up to at most its capacity."""
        st = self._ls.get(l)
        return st is None or st[1] <= l.capacity_bps * (1 + 1e-12)

    def _allocate(self) -> None:
        if not self._dirty:
            return
        dirty, self._dirty = self._dirty, set()
        on, slack = self._on, self._slack
        # Every flow whose rate may change: on a dirty link, or joined to one by binding links.
        seen_flows: set[NetFlow] = set()
        seen_links: set[Link] = set()
        for root in dirty:
            if root in seen_links or root not in on:
                continue
            if slack(root):  # a slack link joins nothing: each of its flows starts a component
                starts = [[f] for f in on[root] if f not in seen_flows]
                stack_of = lambda c: [o for o in c[0].path if not slack(o)]  # noqa: E731
            else:  # a binding link: all its flows are in one component
                starts = [list(on[root])]
                stack_of = lambda c: [root]  # noqa: E731
            for comp in starts:
                if comp[0] in seen_flows:
                    continue
                seen_flows.update(comp)
                stack = [o for o in stack_of(comp) if o not in seen_links]
                seen_links.update(stack)
                while stack:
                    l = stack.pop()
                    for f in on.get(l, ()):
                        if f in seen_flows:
                            continue
                        seen_flows.add(f)
                        comp.append(f)
                    for f in on.get(l, ()):
                        for o in f.path:
                            if o not in seen_links and not slack(o):
                                seen_links.add(o)
                                stack.append(o)
                self._rates(comp)

    def _rates(self, comp: list[NetFlow]) -> None:
        slack = self._slack
        new: dict[NetFlow, float] = {}
        if len(comp) == 1:
            f = comp[0]
            new[f] = f.min_cap
        else:
            binding: list[tuple[Link, ...]] = []
            caps: list[float] = []
            classes = set()
            qos_links = False
            for f in comp:
                b = tuple(l for l in f.path if not slack(l))
                binding.append(b)
                # the slack links still cap the flow alone (they may have been judged slack on
                # each other's capacities): their smallest capacity
                caps.append(min((l.capacity_bps for l in f.path if l not in b), default=math.inf))
                classes.add(f.traffic_class)
                qos_links = qos_links or any(l.qos for l in b)
            self.allocations += 1
            self.allocated_flows += len(comp)
            if len(classes) == 1 or not qos_links:
                rates = _water_fill(binding, caps)
            else:  # both classes on QoS links: HTB's fixed point (flows.max_min_rates)
                proxies = []
                for f, b, c in zip(comp, binding, caps):
                    if c < math.inf and (not b or c < min(l.capacity_bps for l in b)):
                        b = (*b, f._cap_link(c))
                    proxies.append(_Proxy(b, f.traffic_class))
                r = max_min_rates(proxies)
                rates = [r[p] for p in proxies]
            for f, r in zip(comp, rates):
                new[f] = r
        now, heap = self.now, self._heap
        for f, r in new.items():
            if r == f.rate_bps and f.eta < math.inf:
                continue
            if f.rate_bps > 0:
                f.remaining = max(0.0, f.remaining - f.rate_bps / 8 * (now - f.since))
            f.since = now
            f.rate_bps = r
            f._version += 1
            f.eta = now + f.remaining * 8 / r if r > 0 else math.inf
            if f.eta < math.inf:
                heapq.heappush(heap, (f.eta, next(self._seq), f._version, f))

    # ---------------------------------------------------------------- introspection
    def rates(self) -> dict[Hashable, float]:
        """Rate (bit/s) of every active flow, by id."""
        self._allocate()
        out = {}
        for on in self._on.values():
            for f in on:
                out[f.id] = f.rate_bps
        return out

    def flows_on(self, link: Link) -> int:
        return len(self._on.get(link, ()))

    def saturated(self, link: Link) -> bool:
        """Whether the flows on `link` fill it now: their rates add up to its capacity (a slack
        link, and one whose flows are held back elsewhere, has capacity to spare)."""
        on = self._on.get(link)
        if not on or self._slack(link):
            return False
        self._allocate()
        return math.fsum(f.rate_bps for f in on) >= link.capacity_bps * (1 - 1e-9)


def id_of(x: object) -> int:
    return id(x)


def _water_fill(paths: list[tuple[Link, ...]], caps: list[float]) -> list[float]:
    """Max-min fair rates of one class: flow i crosses links paths[i] and may not exceed
    caps[i]. Progressive filling: the level rises until a link is full (its flows freeze at the
    level) or a flow reaches its cap (it freezes there); exactly flows._fill's allocation."""
    n = len(paths)
    rate = [0.0] * n
    frozen = [False] * n
    res: dict[Link, float] = {}
    cnt: dict[Link, int] = {}
    members: dict[Link, list[int]] = {}
    for i, p in enumerate(paths):
        for l in p:
            if l not in res:
                res[l] = l.capacity_bps
                cnt[l] = 0
                members[l] = []
            cnt[l] += 1
            members[l].append(i)
    order = sorted(range(n), key=caps.__getitem__)  # flows by cap, lowest first
    k = 0
    level = 0.0
    left = n
    while left:
        while k < n and frozen[order[k]]:
            k += 1
        best_l, best = None, math.inf
        for l, c in cnt.items():
            if c:
                share = res[l] / c
                if share < best:
                    best_l, best = l, share
        cap_next = caps[order[k]] if k < n else math.inf
        if cap_next <= best:  # a flow reaches its own cap first
            i = order[k]
            level = max(level, cap_next)
            frozen[i], rate[i] = True, cap_next
            left -= 1
            for l in paths[i]:
                res[l] -= cap_next
                cnt[l] -= 1
            continue
        if best_l is None:
            break
        level = max(level, best)
        tol = RATE_RTOL * best_l.capacity_bps
        full = [l for l, c in cnt.items() if c and res[l] - c * best <= tol * max(1.0, c)]
        for l in full:
            for i in members[l]:
                if frozen[i]:
                    continue
                frozen[i], rate[i] = True, best
                left -= 1
                for o in paths[i]:
                    res[o] -= best
                    cnt[o] -= 1
    return rate


class SimNetwork:
    """A FastFlowNetwork driven by a SimPy environment: `transfer` returns an event that succeeds
    with the flow when its last byte arrives. One timer stands for the next completion and is
    re-armed when that instant moves (a superseded timer does nothing when it fires)."""

    def __init__(self, env):
        self.env = env
        self.net = FastFlowNetwork(now=env.now)
        self._armed_at: float | None = None
        self._gen = 0

    def transfer(self, path: Sequence[Link], nbytes: float, traffic_class: str | TrafficClass = KV.name):
        self._sync()
        f = self.net.start(path, nbytes, traffic_class)
        ev = self.env.event()
        if f.done:
            ev.succeed(f)
            return ev
        f.callback = ev
        self._rearm()
        return ev

    def saturated(self, link: Link) -> bool:
        """FastFlowNetwork.saturated, now (its allocation may move the next completion: re-armed)."""
        self._sync()
        full = self.net.saturated(link)
        self._rearm()
        return full

    def _sync(self) -> None:
        for f in self.net.advance_to(max(self.env.now, self.net.now)):
            f.callback.succeed(f)

    def _rearm(self) -> None:
        t = self.net.next_event()
        if t == self._armed_at:
            return
        self._gen += 1
        self._armed_at = t
        if t is None:
            return
        gen = self._gen
        timer = self.env.timeout(max(0.0, t - self.env.now))
        timer.callbacks.append(lambda _ev: self._fire(gen))

    def _fire(self, gen: int) -> None:
        if gen != self._gen:
            return
        self._armed_at = None
        self._sync()
        self._rearm()
