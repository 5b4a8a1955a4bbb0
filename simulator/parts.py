"""The simulated cluster's parts, each a small state machine ClusterSim (cluster.py) drives: the host's CPU, latency jitter, the scheduler's doorbell, a node's host agent, an engine, the jobs queued on them, and a decode engine's batches."""
from __future__ import annotations

import math
import random
from collections import deque
from typing import Any

import simpy

from dualpath.nodes.leader import EngineLoad
from dualpath.scheduler.cost_model import DecodeCostModel
from dualpath.scheduler.records import Role
from dualpath.lifecycle.record import RequestRecord
from .calibration import Calibration
from .flows import Link


def queue_stretch(u: float, servers: int) -> float:
    """How much longer a piece of work takes on `servers` cores that are busy a share `u` of the
    time than on idle ones: an M/M/c queue's mean response time over its service time,
    1 + C(c, a) / (c (1 - u)) with Erlang's C at a = c u. One core gives 1 / (1 - u); two give
    1 / (1 - u^2): at u = 0.63 a latency stretches 1.66x, not the 2.7x of one core twice as fast."""
    c = max(1, int(round(servers)))
    a = c * u
    term, head = 1.0, 1.0  # a^k / k!, and the sum of the terms below c
    for k in range(1, c):
        term *= a / k
        head += term
    wait = term * a / c / (1.0 - u)  # a^c / c! / (1 - u)
    return 1.0 + wait / (head + wait) / (c * (1.0 - u))


class _HostCpu:
    """The testbed host's CPU (calibration.py): cores busy over a sliding window, from the engines'
    compute and the KV bytes the NICs move, and the stretch it gives latencies (queue_stretch)."""

    BUCKETS = 20
    U_MAX = 0.9

    def __init__(self, cal: Calibration):
        self.on = cal.cpu_cores > 0
        self.cal = cal
        self.width = cal.cpu_window_s / self.BUCKETS
        self.compute = [0.0] * self.BUCKETS
        self.bytes = [0.0] * self.BUCKETS
        self.slot = 0  # absolute bucket index of the newest bucket
        self._cache_t = -1.0
        self._cache_f = 1.0

    def _roll(self, now: float) -> int:
        b = int(now / self.width)
        if b > self.slot:
            for i in range(self.slot + 1, min(b, self.slot + self.BUCKETS) + 1):
                self.compute[i % self.BUCKETS] = 0.0
                self.bytes[i % self.BUCKETS] = 0.0
            self.slot = b
        return self.slot % self.BUCKETS

    def add(self, now: float, compute_s: float = 0.0, nbytes: float = 0.0) -> None:
        if self.on:
            i = self._roll(now)
            self.compute[i] += compute_s
            self.bytes[i] += nbytes

    def factor(self, now: float) -> float:
        if not self.on:
            return 1.0
        if now == self._cache_t:
            return self._cache_f
        self._roll(now)
        w = self.cal.cpu_window_s
        c = self.cal
        busy = c.cpu_base + c.cpu_per_compute * sum(self.compute) / w + c.cpu_per_mbps * sum(self.bytes) / w / 1e6
        u = min(max(busy / c.cpu_cores, 0.0), self.U_MAX)
        self._cache_t, self._cache_f = now, queue_stretch(u, c.cpu_cores)
        return self._cache_f


class _Jitter:
    """Lognormal factors of mean 1 and relative standard deviation `sd`, from a seeded stream (a
    string seed hashes the same in every process): one simulation's draws for its latencies."""

    def __init__(self, sd: float, seed: str):
        self.sigma = math.sqrt(math.log1p(sd * sd))
        self.mu = -self.sigma * self.sigma / 2
        self._rng = random.Random(seed)

    def factor(self) -> float:
        return math.exp(self._rng.gauss(self.mu, self.sigma)) if self.sigma else 1.0


class _Bell:
    """A leader's doorbell subscription: rings queue up until the leader waits again."""

    __slots__ = ("rung", "event")

    def __init__(self) -> None:
        self.rung = False
        self.event = None


class _Host:
    """A node's host agent: DRAM buffer, storage NIC, FIFO read queue, host port."""

    def __init__(self, sim: "ClusterSim", name: str):
        cfg = sim.cfg
        self.name = name
        q = cfg.qos
        self.snic_rx = sim.shaped(Link(f"{name}/snic/rx", cfg.snic_bps, qos=False), "snic")
        self.snic_tx = sim.shaped(Link(f"{name}/snic/tx", cfg.snic_bps, qos=False), "snic")
        self.host_rx = sim.shaped(Link(f"{name}/host_port/rx", cfg.host_port_bps, qos=q), "host_port")
        self.host_tx = sim.shaped(Link(f"{name}/host_port/tx", cfg.host_port_bps, qos=q), "host_port")
        self.buffer = simpy.Container(sim.env, capacity=cfg.buffer_bytes, init=cfg.buffer_bytes)
        self.read_q = 0  # bytes of loads accepted and not finished (the node's read_q)
        self.loads: deque = deque()
        self.worker_idle: simpy.Event | None = None
        self.reading = 0  # loads being read right now (0 or 1: one worker)


class _Engine:
    def __init__(self, sim: "ClusterSim", name: str, node: _Host, role: Role, group: str):
        cfg = sim.cfg
        self.name, self.node, self.role, self.group = name, node, role, group
        self.cnic_rx = sim.shaped(Link(f"{name}/cnic/rx", cfg.cnic_bps, qos=cfg.qos), "cnic")
        self.cnic_tx = sim.shaped(Link(f"{name}/cnic/tx", cfg.cnic_bps, qos=cfg.qos), "cnic")
        self.load = EngineLoad(cfg.hbm_tokens if role is Role.DECODE else 0)
        self.last_report: tuple[tuple[int, int], Any] | None = None  # ((load version, read_q), report)


class _DecodeJob:
    __slots__ = ("rec", "ctx", "left", "times", "done", "wb_blocks", "node")

    def __init__(self, rec: RequestRecord, n_prompt: int, gen_len: int, done, wb_blocks: int, node: _Host):
        self.rec = rec
        self.ctx = n_prompt + 1  # keys the first step's token attends to (its own included)
        self.left = gen_len - 1  # steps to run: the first token came from prefill
        self.times: list[float] = []
        self.done = done
        self.wb_blocks = wb_blocks  # Full Blocks the generated tokens complete (D2H at the end)
        self.node = node


class _DecodeEngine:
    """Continuous batching in closed form. A segment is a run of steps with one batch: step i of
    it lasts (A + b i) * k + gap, A = the cost of the batch's contexts at its first step, b = the
    per-context cost times the batch size (every context grows by one per step), plus, under DSA,
    the capped per-context cost times the contexts still under the cap. The segment ends at the
    first step boundary after a job became ready (it joins), when a job runs out of steps (it
    leaves) or when a context reaches the cap (b drops); token times inside it are the boundaries."""

    def __init__(self, sim: "ClusterSim", eng: _Engine):
        self.sim, self.eng = sim, eng
        self.batch: list[_DecodeJob] = []
        self.ready: list[_DecodeJob] = []
        self.t_seg = 0.0
        self.a = 0.0
        self.b = 0.0
        self.gen = 0  # the segment's end event: superseded ones do nothing
        self.end_at = math.inf
        self.emulated = 0.0  # the segment's first step, emulated seconds
        self.gap = 0.0
        self.segments = self.steps = self.step_tokens = 0

    def _costs(self) -> tuple[float, float]:
        sim = self.sim
        c: DecodeCostModel = sim.cfg.decode_cost
        k = sim.cfg.dilation
        n = len(self.batch)
        self.emulated = c.step_cost([j.ctx for j in self.batch])
        self.gap = sim.cal.step_gap_s * sim.cpu.factor(sim.env.now)
        growing = sum(j.ctx < c.context_cap for j in self.batch) if c.context_cap > 0 else 0
        return self.emulated * k + self.gap, (c.per_context * n + c.per_capped_context * growing) * k

    def _steps_linear(self) -> int:
        """The most steps from now over which the step cost stays linear: until a context under
        DSA's cap reaches it (step i attends min(ctx + i, cap) keys), at least one."""
        cap = self.sim.cfg.decode_cost.context_cap
        under = [cap - j.ctx + 1 for j in self.batch if 0 < cap and j.ctx < cap]
        return max(1, min(under)) if under else math.inf

    def _boundary(self, m: int) -> float:
        return self.t_seg + m * self.a + self.b * m * (m - 1) / 2

    def _steps_until(self, t: float) -> int:
        """The first boundary at or after t, as a step count m >= 1 of this segment."""
        dt = t - self.t_seg
        if dt <= 0:
            return 1
        a, b = self.a, self.b
        if b <= 0:
            m = math.ceil(dt / a - 1e-12)
        else:  # b m^2/2 + (a - b/2) m - dt >= 0
            p = a - b / 2
            m = math.ceil((-p + math.sqrt(p * p + 2 * b * dt)) / b - 1e-9)
        m = max(1, m)
        while self._boundary(m) < t - 1e-12 * max(1.0, t):
            m += 1
        while m > 1 and self._boundary(m - 1) >= t:
            m -= 1
        return m

    def add(self, job: _DecodeJob) -> None:
        """A job whose KV is in HBM: into the batch at the next step boundary."""
        now = self.sim.env.now
        if job.left <= 0:
            self._leave(job, now)
            return
        if not self.batch:
            self.batch = [job]
            self._begin(now)
            return
        self.ready.append(job)
        m = self._steps_until(now + 1e-15)
        t = self._boundary(m)
        if t < self.end_at:
            self._arm(t)

    def _begin(self, t: float) -> None:
        self.t_seg = t
        self.a, self.b = self._costs()
        self.segments += 1
        k_min = min(min(j.left for j in self.batch), self._steps_linear())
        self._arm(self._boundary(k_min))

    def _arm(self, t: float) -> None:
        self.gen += 1
        self.end_at = t
        gen = self.gen
        ev = self.sim.env.timeout(max(0.0, t - self.sim.env.now))
        ev.callbacks.append(lambda _e: self._end(gen))

    def _end(self, gen: int) -> None:
        if gen != self.gen:
            return
        now = self.sim.env.now
        m = self._steps_until(now)
        gap = self.gap  # a step's tokens exist when its window ends, before the gap
        bounds = [self._boundary(i) - gap for i in range(1, m + 1)]
        self.steps += m
        n = len(self.batch)
        self.step_tokens += m * n
        a, b, c = self.sim.cal.step_cpu  # the testbed model's compute for these steps (host CPU)
        if a or b or c:
            k = self.sim.cfg.dilation
            emul = m * self.emulated + (self.b / k) * m * (m - 1) / 2 if k else 0.0
            self.sim.cpu.add(now, compute_s=m * (a + b * n) + c * emul)
        still = []
        for j in self.batch:
            j.times.extend(bounds)
            j.ctx += m
            j.left -= m
            if j.left <= 0:
                self._leave(j, bounds[-1])
            else:
                still.append(j)
        self.batch = still + self.ready
        self.ready = []
        self.end_at = math.inf
        if self.batch:
            self._begin(self._boundary(m))

    def _leave(self, job: _DecodeJob, t: float) -> None:
        self.sim.env.process(self.sim._decode_finish(self.eng, job))
