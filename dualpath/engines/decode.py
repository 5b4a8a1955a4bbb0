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

With a collective (the group's AllToAll, dualpath/engines/collective.py) a step is n_layer layer
windows, each followed by one collective over the CNIC for the batch's tokens; a thread runs
them on the target's schedule (layer l's collective starts when its window ends) while the loop
goes on, and wakes the loop through `wake_fd` when the step is over. The collectives' real time
extends the step; only the compute can make it late, as without them.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

from dualpath.kv.decode_connector import DecodeConnector, DecodePlan
from dualpath.engines.clock import DeviceClock, PassTiming
from dualpath.engines.collective import CollectiveGroup
from dualpath.kv.layouts import BlockGeometry
from dualpath.model import DecodeCache, Transformer
from dualpath.scheduler.cost_model import DecodeCostModel
from dualpath.scheduler.hbm import DecodeHbm


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
    end: float  # without collectives: when the window ends; with them: set by the thread when done
    timing: PassTiming
    done: threading.Event | None = None  # set when the step's collectives are over (None: none)
    error: str | None = None


class DecodeBatcher:
    """The engine's requests between steps: loading, in the batch, or finishing their saves."""

    def __init__(self, model: Transformer, geom: BlockGeometry, clock: DeviceClock | None = None,
                 cost: DecodeCostModel | None = None, collective: CollectiveGroup | None = None,
                 hbm: DecodeHbm | None = None) -> None:
        """`hbm`: the target's HBM for KV, which each step's record measures its batch against."""
        self.model, self.geom, self.hbm = model, geom, hbm
        self.collective = collective
        # the collectives' thread writes a byte here when a step ends, so the loop wakes at once
        self.wake_fd, self._wake_w = os.pipe() if collective is not None else (None, None)
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
        """Seconds until the running step's window ends (None if no step is running, or if its
        collectives decide when it ends: then `wake_fd` says so)."""
        if self._step is None or self._step.done is not None:
            return None
        return max(0.0, self._step.end - self.clock.now())

    def _step_over(self, step: _Step) -> bool:
        if step.done is not None:
            return step.done.is_set()
        return self.clock.now() >= step.end

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
        if self._step is not None and self._step_over(self._step):
            if self._step.error:
                for job in self._step.jobs:
                    self._fail(job, RuntimeError(self._step.error))
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
        if self.collective is not None:
            self._step.done = threading.Event()
            threading.Thread(target=self._collectives, args=(self._step, len(jobs)), daemon=True,
                             name="dpt-collective").start()

    def _collectives(self, step: _Step, n_tokens: int) -> None:
        """The step's layers on the target's schedule: layer l's window, then its collective.
        The step's windows end together where the compute's deadline put them (`step.end`); a
        compute that ran late (already recorded) starts the collectives late."""
        n_layer = self.model.config.n_layer
        window = (step.end - step.start) / n_layer
        sched = step.start
        try:
            for _ in range(n_layer):
                sched += window
                self.clock.sleep_until(sched)
                rec = self.collective.run(n_tokens)
                sched += rec.latency_s
                step.timing.collective_s += rec.latency_s
                step.timing.collectives += 1
        except Exception as e:  # the step's jobs fail with it, in the loop's thread
            step.error = f"collective: {type(e).__name__}: {e}"
        step.end = max(sched, self.clock.now())
        step.done.set()
        os.write(self._wake_w, b"x")

    def _publish(self, step: _Step) -> None:
        t = step.end
        for job, tok in zip(step.jobs, step.new):
            job.tokens.append(tok)
            job.token_times.append(t)
            self._save_full_blocks(job)
            (self.finishing if job.done_decoding or job.error else self.batch).append(job)
        rec = {"t_start": step.start, "t_end": t, "n": len(step.jobs), **self._hbm_fields(step.jobs),
               **step.timing.to_dict(), "overran": step.timing.overran}
        if self.collective is not None:
            rec["collective_log"] = self.collective.take_log()
        self.step_log.append(rec)

    def _hbm_fields(self, jobs: list[DecodeJob]) -> dict:
        tokens = sum(j.n_kv for j in jobs)
        if self.hbm is None:
            return {"batch_tokens": tokens, "hbm_peak_bytes": None, "hbm_limited": False}
        return self.hbm.batch_record(tokens, len(jobs))

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
