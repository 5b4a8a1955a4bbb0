"""DE assignment in two phases (DESIGN.md section 8, paper section 6.1).

Phase 1 drains the global queue: each request goes to the DE group whose total tok (engines plus
requests already queued for it) is least, so groups stay balanced before HBM is even looked at.
Phase 2 runs inside one group when its leader pulls: engines are bounded by free HBM, so it is not
FIFO across groups, but it is within a group (the head blocks when nothing fits, never skipped).
"""
from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import islice

from .records import EngineState, Request

Z_MARGIN = 1.05  # the paper's 5 % tolerance band that stops flapping around the mean


class GroupBalancer:
    """Which DE group has the least total tok, in O(log G) per query.

    A lazy min-heap: every change pushes a fresh (total, group) entry and stale entries are
    dropped when they reach the top, so reports (which change totals constantly) cost one push
    instead of a rebuild per drain. Ties go to the smaller group id, deterministically.
    """

    def __init__(self) -> None:
        self.totals: dict[str, int] = {}
        self._heap: list[tuple[int, str]] = []

    def __len__(self) -> int:
        return len(self.totals)

    def set(self, group_id: str, total: int) -> None:
        if self.totals.get(group_id) == total:
            return
        self.totals[group_id] = total
        heapq.heappush(self._heap, (total, group_id))
        if len(self._heap) > 4 * len(self.totals) + 64:  # stale entries pile up: compact
            self._heap = [(t, g) for g, t in self.totals.items()]
            heapq.heapify(self._heap)

    def add(self, group_id: str, tokens: int) -> None:
        self.set(group_id, self.totals[group_id] + tokens)

    def remove(self, group_id: str) -> None:
        self.totals.pop(group_id, None)  # its heap entries turn stale

    def least(self) -> str | None:
        heap, totals = self._heap, self.totals
        while heap:
            t, g = heap[0]
            if totals.get(g) == t:
                return g
            heapq.heappop(heap)
        return None


def distribute_to_groups(
    global_queue: deque[Request],
    balancer: GroupBalancer,
    private_queues: dict[str, deque[Request]],
) -> list[tuple[Request, str]]:
    """Phase 1: empty `global_queue` into `private_queues`, least total tok first.

    The balancer's totals count each group's engines plus what is already queued for it, and are
    raised here as requests land, so consecutive requests spread instead of piling on one group.
    """
    out: list[tuple[Request, str]] = []
    if not len(balancer):
        return out
    while global_queue:
        req = global_queue.popleft()
        gid = balancer.least()
        assert gid is not None
        balancer.add(gid, req.total_len)
        private_queues[gid].append(req)
        out.append((req, gid))
    return out


def fitting_prefix(queue: Iterable[Request], total_free_hbm: int) -> tuple[int, int]:
    """R: the longest queue prefix whose tokens fit the group's free HBM, assuming no
    fragmentation. Returns (len(R), sum of len_r over R)."""
    n = 0
    s = 0
    for req in queue:
        if s + req.total_len > total_free_hbm:
            break
        s += req.total_len
        n += 1
    return n, s


def compute_z(sum_len_r: int, engines: Sequence[EngineState]) -> float:
    """Z = 1.05 * (sum_{r in R} len_r + sum_{e in E} tok_e) / |E|: the balanced per-engine load
    after R is placed, plus the margin."""
    if not engines:
        raise ValueError("compute_z needs at least one engine")
    return Z_MARGIN * (sum_len_r + sum(e.tok for e in engines)) / len(engines)


def pick_de(req_len: int, engines: Sequence[EngineState], z: float) -> EngineState | None:
    """Among engines with free HBM >= req_len: those staying <= Z win, least seq_e (then tok,
    index); otherwise least tok_e (then index). None when nothing fits."""
    best_norm: EngineState | None = None
    best_high: EngineState | None = None
    for e in engines:
        if e.free_hbm < req_len:
            continue
        if e.tok + req_len <= z:
            if best_norm is None or (e.seq, e.tok, e.index) < (best_norm.seq, best_norm.tok, best_norm.index):
                best_norm = e
        elif best_high is None or (e.tok, e.index) < (best_high.tok, best_high.index):
            best_high = e
    return best_norm if best_norm is not None else best_high


def assign_de_in_group(
    private_queue: Sequence[Request], engines: Sequence[EngineState]
) -> tuple[list[tuple[Request, EngineState]], float]:
    """Phase 2 for one group. Mutates chosen engines' tok, seq and free_hbm (so HBM is never
    overcommitted within the call). Returns the assigned FIFO prefix and the Z used."""
    if not engines:
        return [], 0.0
    n_r, sum_len = fitting_prefix(private_queue, sum(e.free_hbm for e in engines))
    z = compute_z(sum_len, engines)
    out: list[tuple[Request, EngineState]] = []
    # Beyond R the total free HBM is exhausted, so nothing past it could fit anyway.
    for req in islice(private_queue, n_r):
        e = pick_de(req.total_len, engines, z)
        if e is None:
            break
        e.tok += req.total_len
        e.seq += 1
        e.free_hbm -= req.total_len
        out.append((req, e))
    return out, z
