"""Compute-quota batch packing on a PE (intra-engine scheduling, paper section 6.2).

Requests join the forward batch in FIFO order while the predicted attention time stays within the
quota (paper: 300 ms) and, when an HBM limit is given (dualpath/scheduler/hbm.py), while the KV the
pass keeps resident fits the engine's HBM. The first one that would overflow either is chunked:
the largest number of its new tokens that still fits both, the rest waits for the next pass.
Capping every data-parallel peer's pass at the same quota is what keeps their attention times
close, so peers do not idle at the barrier before the FFN.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .cost_model import AttentionCostModel
from .hbm import HbmLimit

DEFAULT_QUOTA_S = 0.3


@dataclass(slots=True)
class PrefillItem:
    request_id: str
    cached: int  # tokens whose KV exists (storage hits plus earlier chunks)
    new: int  # tokens still to compute


@dataclass(frozen=True, slots=True)
class BatchEntry:
    request_id: str
    cached: int
    new: int  # tokens computed in this pass
    last: bool  # this pass finishes the request's prefill


@dataclass(frozen=True, slots=True)
class PackedBatch:
    entries: tuple[BatchEntry, ...]
    predicted_s: float
    quota_s: float
    # True only when not even one token of the head fits an empty batch; it is then admitted alone
    # anyway, because a quota that can never be met must not starve the engine.
    over_quota: bool = False
    hbm_bytes: float = 0.0  # the KV the pass keeps in HBM, target bytes (0: no limit given)
    hbm_limited: bool = False  # HBM, not the quota or the queue, ended the batch

    @property
    def batch_tokens(self) -> int:
        """Tokens the pass holds: every entry's past plus what it computes."""
        return sum(e.cached + e.new for e in self.entries)

    def pairs(self) -> list[tuple[int, int]]:
        return [(e.cached, e.new) for e in self.entries]


def largest_fitting_chunk(model: AttentionCostModel, cached: int, new: int, used_s: float, quota_s: float) -> int:
    """Largest k in [0, new] with used_s + cost(cached, k) <= quota_s (binary search; the cost
    is non-decreasing in k because the model's coefficients are >= 0)."""
    lo, hi = 0, new  # invariant: k = lo fits (cost(.,0) = 0 adds nothing), answer in [lo, hi]
    if used_s > quota_s:
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if used_s + model.request_cost(cached, mid) <= quota_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def pack_batch(queue: Sequence[PrefillItem], model: AttentionCostModel, quota_s: float = DEFAULT_QUOTA_S,
               hbm: HbmLimit | None = None) -> PackedBatch:
    """One forward batch from the head of `queue`; does not modify the queue. With `hbm`, a
    head whose past alone does not fit what the batch left waits for the next pass (raise
    NeverFits first, on push, for one that fits no pass: an empty engine would spin on it)."""
    if quota_s <= 0:
        raise ValueError("quota_s must be > 0")
    used, held = model.intercept, 0.0
    entries: list[BatchEntry] = []

    def done(**kw) -> PackedBatch:
        return PackedBatch(tuple(entries), used, quota_s, hbm_bytes=held, **kw)

    for item in queue:
        if item.new <= 0:
            continue
        fit = item.new if hbm is None else hbm.largest_new(held, item.cached, item.new)
        cost = model.request_cost(item.cached, item.new)
        if fit == item.new and used + cost <= quota_s:
            entries.append(BatchEntry(item.request_id, item.cached, item.new, True))
            used += cost
            held += hbm.resident_bytes(item.cached, item.new) if hbm else 0.0
            continue
        k = min(fit, largest_fitting_chunk(model, item.cached, item.new, used, quota_s))
        if k > 0:
            entries.append(BatchEntry(item.request_id, item.cached, k, False))
            used += model.request_cost(item.cached, k)
            held += hbm.resident_bytes(item.cached, k) if hbm else 0.0
            return done(hbm_limited=fit < item.new and fit == k)
        if not entries and fit == 0:
            hbm.check_request(item.request_id, item.cached + 1)  # raises: its past fits no pass
        if not entries:
            e = BatchEntry(item.request_id, item.cached, 1, item.new == 1)
            used += model.request_cost(item.cached, 1)
            entries.append(e)
            held += hbm.resident_bytes(item.cached, 1) if hbm else 0.0
            return done(over_quota=True)
        return done(hbm_limited=fit < item.new)  # FIFO: the head that does not fit ends the batch
    return done()


class PrefillQueue:
    """A PE's FIFO of prefill work that remembers chunk progress between passes."""

    def __init__(self, model: AttentionCostModel, quota_s: float = DEFAULT_QUOTA_S,
                 hbm: HbmLimit | None = None) -> None:
        self.model = model
        self.quota_s = quota_s
        self.hbm = hbm
        self._q: deque[PrefillItem] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def push(self, request_id: str, cached: int, new: int) -> None:
        if cached < 0 or new <= 0:
            raise ValueError("need cached >= 0 and new > 0")
        if self.hbm is not None:
            self.hbm.check_request(request_id, cached + new)
        self._q.append(PrefillItem(request_id, cached, new))

    def next_batch(self) -> PackedBatch:
        """Pack the next pass and advance: finished requests leave, a chunked one stays at the
        head with its computed tokens now counted as cached."""
        batch = pack_batch(self._q, self.model, self.quota_s, self.hbm)
        for e in batch.entries:
            head = self._q[0]
            assert head.request_id == e.request_id
            if e.last:
                self._q.popleft()
            else:
                head.cached += e.new
                head.new -= e.new
        return batch

    def drop(self, request_id: str) -> None:
        """Forget a request's remaining work (its pass failed)."""
        self._q = deque(item for item in self._q if item.request_id != request_id)
