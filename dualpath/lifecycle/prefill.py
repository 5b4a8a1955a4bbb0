"""Prefill batching, once for both executors: each PE's waiting work packed pass by pass.

A PE's passes run FIFO while it has work. Each pass is packed under the compute quota by the
cost model (dualpath.scheduler.batching.PrefillQueue); a request that would overflow it is
chunked, and a later chunk reads its past, hits and earlier chunks, back from the DE buffer.
"""
from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

from dualpath.kv.plan import RequestPlan
from dualpath.lifecycle.record import RequestRecord
from dualpath.lifecycle.steps import NextInstant, PassOutcome, PassResult, RunPass, StepError
from dualpath.scheduler.batching import PrefillQueue
from dualpath.scheduler.cost_model import AttentionCostModel
from dualpath.scheduler.hbm import HbmLimit, NeverFits


class PrefillJob:
    """A request's prefill, pass by pass: how far it got and what its passes returned.
    `done(job, error)` is the executor's: it wakes whoever waits for the job."""

    __slots__ = ("rec", "plan", "rid", "n_prompt", "n_past", "passes", "crcs", "first_token", "t_first_token",
                 "done", "io")

    def __init__(self, rec: RequestRecord, plan: RequestPlan, rid: str, n_past: int,
                 done: Callable[[PrefillJob, StepError | None], None], io: Any = None) -> None:
        self.rec, self.plan, self.rid, self.n_past, self.done, self.io = rec, plan, rid, n_past, done, io
        self.n_prompt = plan.n_prompt
        self.passes = 0
        self.crcs: list[int] | None = None  # per layer, of rows [0, n_past) as the last pass wrote them
        self.first_token = -1
        self.t_first_token = 0.0  # the end of the pass that produced it

    @property
    def first(self) -> bool:
        """The next pass is the first: it loads the stored hits (a later chunk reads its whole
        past back from the DE buffer)."""
        return self.passes == 0

    @property
    def tags(self) -> list[str]:
        """Each pass's tag, which names its layers' notifications."""
        return [f"/c{i}" for i in range(self.passes)]

    def absorb(self, res: PassResult, n_new: int, kv_bytes_per_token: int) -> None:
        r = self.rec
        if self.first:  # the first pass loaded the stored hits: what verification checks
            r.pe_layer_hashes, r.peak_hit_bytes = res.layer_hashes, res.peak_hit_bytes
            r.connectors = (res.connector, r.connectors[1])
        else:
            r.chunk_read_bytes += self.n_past * kv_bytes_per_token
        r.chunk_read_bytes += res.reread_bytes
        r.read_wait_s += res.read_wait_s
        r.attention_s += res.attention_s
        r.passes += 1
        self.passes += 1
        self.crcs = res.crcs
        self.n_past += n_new
        self.first_token = res.first_token


class PrefillBatcher:
    """Every PE's queue of prefill work. `push` a job; when it says so, the executor runs the
    PE's `passes` (a generator of steps) until the queue is empty."""

    def __init__(self, cost_model: AttentionCostModel, quota_s: float, kv_bytes_per_token: int,
                 now: Callable[[], float], hbm: HbmLimit | None = None) -> None:
        """`hbm`: the PE's HBM limit under this run's connector (None: the quota alone)."""
        self.cost_model, self.quota_s, self.kvb, self.now = cost_model, quota_s, kv_bytes_per_token, now
        self.hbm = hbm
        self.queues: dict[str, PrefillQueue] = {}
        self.jobs: dict[str, PrefillJob] = {}
        self.running: set[str] = set()
        self.passes: list[dict[str, Any]] = []  # one per forward pass: engine, times, attention seconds

    def push(self, engine: str, job: PrefillJob) -> bool:
        """Queue `job` on `engine`; True: its passes are not running, start them."""
        q = self.queues.get(engine)
        if q is None:
            q = self.queues[engine] = PrefillQueue(self.cost_model, self.quota_s, self.hbm)
        try:
            q.push(job.rid, job.n_past, job.n_prompt - job.n_past)
        except NeverFits as e:
            raise StepError(str(e)) from e
        self.jobs[job.rid] = job
        if engine in self.running:
            return False
        self.running.add(engine)
        return True

    def passes_of(self, engine: str) -> Generator[Any, Any, None]:
        """The engine's forward passes while it has waiting work, FIFO, packed under the quota."""
        q = self.queues[engine]
        while len(q):
            yield NextInstant()  # requests arriving in this same instant join the pass
            batch = q.next_batch()
            jobs = [self.jobs[e.request_id] for e in batch.entries]
            loaded = len(q) > 0  # work is left over: the quota, not the queue, ended this pass
            t0 = self.now()
            try:
                out: PassOutcome = yield RunPass(engine, jobs, batch)
            except StepError as e:
                for j, entry in zip(jobs, batch.entries):
                    if not entry.last:
                        q.drop(entry.request_id)
                    del self.jobs[entry.request_id]
                    j.done(j, e)
                continue
            self.passes.append({"pe": engine, "t_start": t0, "t_end": self.now(), "n": len(jobs),
                                "chunked": not batch.entries[-1].last, "loaded": loaded,
                                "batch_tokens": batch.batch_tokens, "hbm_peak_bytes": round(batch.hbm_bytes) if self.hbm else None,
                                "hbm_limited": batch.hbm_limited, **out.record})
            for j, e, res in zip(jobs, batch.entries, out.results):
                j.absorb(res, e.new, self.kvb)
                if e.last:
                    j.t_first_token = out.t_end
                    del self.jobs[e.request_id]
                    j.done(j, None)
        self.running.discard(engine)
