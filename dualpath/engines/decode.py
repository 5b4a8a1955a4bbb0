"""Decode engine (DE): continuous batching of every ready request, one token per step.

A request joins the batch once its prompt KV is in HBM (its connector says so) and leaves it
after its last token. Every step computes one token for each request in the batch with the
real model (one batched step, bit-identical to decoding each alone: Transformer.decode_step),
then lasts as long as the target GPU's step for that batch (the decode cost model: weights
streamed once per step, plus each sequence's token and context). The paper's DEs batch every
ready request (section 6) in the same way.

A step's tokens exist when its window ends: that is when they are timestamped, and when a Full
Block that one of them completed starts its write-back (D2H through the CNIC). While a step's
window runs, the engine's loop goes on admitting requests and polling their loads, as a GPU
overlaps copies with compute.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from dualpath.kv.decode_connector import DecodeConnector, DecodePlan
from dualpath.engines.clock import DeviceClock, PassTiming
from dualpath.kv.layouts import BlockGeometry
from dualpath.model import DecodeCache, Transformer
from dualpath.scheduler.cost_model import DecodeCostModel


@dataclass
class DecodeJob:
    plan: DecodePlan
    first_token: int  # from prefill
    t_first_token: float  # when prefill produced it (the PE's clock: the same host clock)
    conn: DecodeConnector
    reply: object = None  # whatever the caller needs to answer when the job is done
    kv: DecodeCache | None = None  # the sequence's KV in HBM once loaded
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    next_block: int = 0  # the first Full Block not yet saved
    error: str | None = None

    @property
    def n_kv(self) -> int:
        return self.kv.n if self.kv else 0

    @property
    def done_decoding(self) -> bool:
        return len(self.tokens) >= self.plan.gen_len


@dataclass
class _Step:
    jobs: list[DecodeJob]
    new: list[int]  # per job: the token, published at `end` (its KV is already in the job's cache)
    start: float
    end: float
    timing: PassTiming


class DecodeBatcher:
    """The engine's requests between steps: loading, in the batch, or finishing their saves."""

    def __init__(self, model: Transformer, geom: BlockGeometry, clock: DeviceClock | None = None,
                 cost: DecodeCostModel | None = None) -> None:
        self.model, self.geom = model, geom
        self.clock = clock or DeviceClock()
        if self.clock.emulated and cost is None:
            raise ValueError("an emulated clock needs the target's decode cost model")
        self.cost = cost
        self.loading: list[DecodeJob] = []
        self.batch: list[DecodeJob] = []
        self.finishing: list[DecodeJob] = []
        self.step_log: list[dict] = []  # one record per step: batch size, timing
        self._step: _Step | None = None

    # -- requests in ----------------------------------------------------------------------------
    def admit(self, job: DecodeJob) -> None:
        job.tokens = [job.first_token]
        job.token_times = [job.t_first_token]
        job.next_block = job.plan.first_new_block
        try:
            job.conn.start_load(job.plan)
        except Exception as e:
            self._fail(job, e)
            self.finishing.append(job)
            return
        self.loading.append(job)

    @property
    def idle(self) -> bool:
        return not (self.loading or self.batch or self.finishing or self._step)

    def wants_step(self) -> bool:
        return self._step is None and bool(self.batch)

    def step_due_in(self) -> float | None:
        """Seconds until the running step's window ends (None if no step is running)."""
        return None if self._step is None else max(0.0, self._step.end - self.clock.now())

    # -- progress -------------------------------------------------------------------------------
    def poll(self) -> list[DecodeJob]:
        """Advance loads, end a step whose window is over, finish saves; returns finished jobs."""
        still = []
        for job in self.loading:
            try:
                kv = job.conn.poll_load()
            except Exception as e:
                self._fail(job, e)
                self.finishing.append(job)
                continue
            if kv is None:
                still.append(job)
                continue
            job.kv = DecodeCache(self.model, kv)
            self._save_full_blocks(job)  # blocks the prompt itself completed
            (self.finishing if job.done_decoding or job.error else self.batch).append(job)
        self.loading = still
        if self._step is not None and self.clock.now() >= self._step.end:
            self._publish(self._step)
            self._step = None
        done, still = [], []
        for job in self.finishing:
            try:
                saved = job.error is not None or job.conn.poll_save()
            except Exception as e:
                self._fail(job, e)
                saved = True
            if saved:
                job.conn.close()
                done.append(job)
            else:
                still.append(job)
        self.finishing = still
        return done

    def begin_step(self) -> None:
        """Compute one token for every request in the batch; its window ends later (poll)."""
        jobs, self.batch = self.batch, []
        timing = PassTiming()
        t0 = self.clock.now()
        c0, u0 = time.perf_counter(), time.thread_time()
        new = self.model.decode_step([j.tokens[-1] for j in jobs], [j.kv for j in jobs])
        timing.compute_wall_s = time.perf_counter() - c0
        timing.compute_cpu_s = time.thread_time() - u0
        emulated = self.cost.step_cost([j.n_kv for j in jobs]) if self.clock.emulated else 0.0  # keys incl. the new one
        end = self.clock.deadline(t0, emulated, timing)
        self._step = _Step(jobs, new, t0, end, timing)

    def _publish(self, step: _Step) -> None:
        t = step.end
        for job, tok in zip(step.jobs, step.new):
            job.tokens.append(tok)
            job.token_times.append(t)
            self._save_full_blocks(job)
            (self.finishing if job.done_decoding or job.error else self.batch).append(job)
        self.step_log.append({"t_start": step.start, "t_end": t, "n": len(step.jobs), **step.timing.to_dict(),
                              "overran": step.timing.overran})

    def _save_full_blocks(self, job: DecodeJob) -> None:
        """Every Full Block the request's KV has completed and not yet saved, as soon as it fills."""
        bs = self.geom.block_size
        try:
            while (job.next_block + 1) * bs <= job.n_kv:
                job.conn.save_block(job.next_block, job.kv.kv())
                job.next_block += 1
        except Exception as e:
            self._fail(job, e)

    @staticmethod
    def _fail(job: DecodeJob, e: Exception) -> None:
        if job.error is None:
            job.error = f"{type(e).__name__}: {e}"
