"""The conductor: drives trajectories through the cluster in one mode, request by request.

A request's lifecycle is dualpath.lifecycle (the same code the simulator runs): the conductor
performs its steps on the real cluster. The scheduler routes (testbed/cluster/scheduling.py), the
host agents hand out areas of their DRAM buffers, load hit Full Blocks into them and flush written
ones to the store, the PE's layerwise passes read the past KV and write KV to the DE buffer
through its connector, and the DE decodes. Trajectories run concurrently; each process serves one
command at a time, so queues form where a real cluster's would.

Each PE's forward passes are packed under the compute quota by the cost model (the target GPU's
on an emulated clock, the engine's own fit on the CPU's), chunking the request that would
overflow it (dualpath.lifecycle.prefill). Decode engines batch every ready request themselves;
the conductor keeps one decode outstanding per request.

Faults (testbed/cluster/faults.py): a request whose engines or DE host agent die under it starts
over as a new request to the scheduler (which no longer offers them), at most
dualpath.lifecycle.request.MAX_ATTEMPTS times; hit blocks that cannot be read (corrupt, missing,
their server or the node's SNIC down, the node's host agent gone) are recomputed from the first
of them, and its write-back repairs them; a write-back the store refuses (a full disk) leaves the
request complete and its blocks unstored.
What each request met is charged to the fault that explains it (FaultLog).

Timestamps are the host's monotonic clock (shared by every process on this
machine) minus the mode's start: testbed seconds. On an emulated clock one
emulated second lasts `dilation` of them.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from dualpath.control import ControlError
from dualpath.kv.buffers import OutOfSpace
from dualpath.kv.connector import PastRead
from dualpath.kv.layouts import BlockGeometry
from dualpath.kv.plan import Load, Route
from dualpath.kv.spans import Span
from dualpath.lifecycle.drive import run_async
from dualpath.lifecycle.index import StoreIndex
from dualpath.lifecycle.prefill import PrefillBatcher, PrefillJob
from dualpath.lifecycle.record import RequestRecord
from dualpath.lifecycle.request import RequestLifecycle
from dualpath.lifecycle.steps import (AfterFailure, Allocate, AskRoute, AwaitLayers, Decode, DecodeOutcome, GaveUp,
                                      LoadHits, NextInstant, PassOutcome, PassResult, Prefill, Release, RunPass,
                                      StepError, WriteBack)
from dualpath.scheduler.cost_model import AttentionCostModel
from dualpath.scheduler.hbm import HbmPlan
from dualpath.store.keys import chain_keys
from dualpath.timeouts import scaled
from dualpath.workload import Trajectory
from testbed.cluster.faults import FaultLog
from testbed.cluster.modes import MODES, connector_of  # MODES is re-exported here
from testbed.cluster.processes import Cluster
from testbed.cluster.scheduling import Router

_SURVIVABLE = (ControlError, OutOfSpace)  # what a step may raise and the request survive (retried or failed)


def flush_timeout_s(base_s: float, bytes_queued: int, rate_bps: float, margin: float = 2.0) -> float:
    """How long a write-back may take: the request timeout plus, with margin, the time the write
    path needs for every byte queued for it up to and including this flush. A burst of turns
    whose new KV outgrows the write path queues for minutes (fig14's full size: 288 agents' first
    turns), which is a queue that moves, not a hang."""
    return base_s + margin * bytes_queued * 8 / rate_bps if rate_bps > 0 else base_s


class Conductor:
    def __init__(self, cluster: Cluster, geom: BlockGeometry, mode: str, namespace: bytes, router: Router,
                 request_timeout_s: float = scaled(120.0), on_record: Callable[[RequestRecord], None] | None = None,
                 cost_model: AttentionCostModel | None = None, quota_s: float = 0.3,
                 faults: FaultLog | None = None, hbm: HbmPlan | None = None):
        """`cost_model` packs the PEs' passes under `quota_s` (both in the engines' time: the
        target's seconds on an emulated clock); None packs every waiting request into one pass.
        `hbm`: the target's HBM per engine, which passes are packed against too (None: no limit)."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
        self.c, self.geom, self.mode, self.ns = cluster, geom, mode, namespace
        self.timeout_s = request_timeout_s
        self.on_record = on_record or (lambda r: None)
        self.index = StoreIndex()  # blocks a request may count as hits, and those the store acknowledged
        self.faults = faults if faults is not None else FaultLog()
        self._space = asyncio.Condition()  # notified when an area is freed (counted per node in _frees)
        self._frees: dict[str, int] = {}
        self.router = router
        self.connector = connector_of(mode)
        self.t0 = time.monotonic()
        self.batcher = PrefillBatcher(cost_model or AttentionCostModel(), quota_s, geom.kv_bytes_per_token, self._now,
                                      hbm.prefill(self.connector) if hbm else None)
        self.lifecycle = RequestLifecycle(geom, self.connector, self.index, cluster.host_of, self._now,
                                          request_timeout_s, hbm)
        self._passes: dict[str, asyncio.Future] = {}  # per PE: its running passes
        self._flushing: dict[str, int] = {}  # per DE node: write-back bytes its flushes have in flight
        topo = cluster.fab.topo  # what every write-back crosses: a node's SNIC, the storage servers' NICs
        self._write_bps = min(topo.snic_bps, topo.spec.storage.servers * topo.storage_nic_bps)
        self._handlers = {AskRoute: self._ask_route, Allocate: self._allocate, Release: self._release,
                          LoadHits: self._load_hits, Prefill: self._prefill, AwaitLayers: self._await_layers,
                          Decode: self._decode, WriteBack: self._write_back, AfterFailure: self._after_failure,
                          GaveUp: self._gave_up, NextInstant: self._next_instant, RunPass: self._run_pass}

    @property
    def batches(self) -> list[dict]:
        """One per forward pass: engine, times, attention seconds."""
        return self.batcher.passes

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _dead(self, *names: str) -> list[str]:
        return [n for n in names if n and not self.c.procs[n].alive()]

    # -- one request ---------------------------------------------------------------------------
    async def request(self, rec: RequestRecord, prompt: list[int], gen_len: int) -> RequestRecord:
        """One turn through the lifecycle (retried while processes it depended on die); an
        error names the request and the fault it met."""
        bs, ns = self.geom.block_size, self.ns
        rec.prompt = prompt
        steps = self.lifecycle.request(rec, prompt, gen_len, chain_keys(prompt, bs, namespace=ns),
                                       lambda r: chain_keys(prompt + r.tokens[:-1], bs, namespace=ns))
        await run_async(steps, self._perform, _SURVIVABLE)
        self.on_record(rec)
        return rec

    async def _perform(self, step: Any) -> Any:
        handler = self._handlers.get(type(step))
        if handler is None:
            raise TypeError(f"the conductor cannot perform {type(step).__name__}")
        return await handler(step)

    # -- the lifecycle's steps -----------------------------------------------------------------
    async def _ask_route(self, step: AskRoute) -> Route:
        rec = step.rec
        try:
            route = await self.router.route(step.request, self.timeout_s)
        except (asyncio.TimeoutError, ControlError) as e:
            raise StepError(str(e) or f"no engine admitted the request within {self.timeout_s:g} s", cause=e) from e
        rec.t_routed, rec.pe, rec.de = self._now(), route.pe, route.de
        if dead := self._dead(route.pe, route.de, self.c.host_of(route.de)):  # decided before it died
            self.faults.process_died(rec, dead[0], self._now(), f"routed to {dead[0]}, which had exited: retried")
            await self.router.release(step.request.request_id, route.pe, route.de)  # the live one stops counting it
            raise StepError(f"{dead[0]} exited", retry=True)
        if route.avoided:
            self.faults.avoided(rec, route.avoided, self._now())
        return route

    async def _allocate(self, step: Allocate) -> tuple[int, str]:
        """An area of its node's DRAM buffer from the node's host agent, which owns the buffer's
        allocator: (offset, the agent's epoch). While the buffer is full it waits for this
        conductor to free some there, and asks again (bounded by the request timeout)."""
        node, nbytes = step.area.node, step.area.blocks * self.geom.full_block_bytes
        deadline = time.monotonic() + self.timeout_s
        while True:
            seen = self._frees.get(node, 0)
            got = await self.c.jobs[node].call("alloc", nbytes=nbytes, timeout_s=self.timeout_s)
            if got["offset"] is not None:
                return got["offset"], got["epoch"]
            if time.monotonic() > deadline:
                raise OutOfSpace(f"{node}: {got.get('error', 'no room')} for {self.timeout_s:g} s")
            async with self._space:
                if self._frees.get(node, 0) == seen:  # nothing freed there since it asked
                    try:
                        await asyncio.wait_for(self._space.wait(), timeout=0.5)
                    except asyncio.TimeoutError:
                        pass

    async def _release(self, step: Release) -> None:
        """Give an area back to its host agent. One whose agent died went with its buffer."""
        node, (offset, epoch) = step.area.node, step.handle
        try:
            await self.c.jobs[node].call("free", offset=offset, epoch=epoch, timeout_s=self.timeout_s)
        except ControlError:
            if not self._dead(node):
                raise
        async with self._space:
            self._frees[node] = self._frees.get(node, 0) + 1
            self._space.notify_all()

    async def _load_hits(self, step: LoadHits) -> int:
        """The plan's loads from the store, every side at once (a split reads both). Returns how
        many leading hit blocks are in place: a block that could not be read (missing, corrupt,
        its server or the node's SNIC down, the node's host agent gone) and all after it are
        recomputed instead; a missing or corrupt one is no longer counted as stored (its
        write-back by this request repairs it)."""
        plan = step.plan
        got = await asyncio.gather(*(self._load(step, x) for x in plan.loads))
        n_ok = plan.n_hit_blocks
        for x, k in zip(plan.loads, got):
            if k < len(x.keys):
                n_ok = min(n_ok, x.first_block + k)
        return n_ok

    async def _load(self, step: LoadHits, x: Load) -> int:
        """One load; how many of its leading blocks landed."""
        rec, fb = step.rec, self.geom.full_block_bytes
        try:
            res = await self.c.loaders[x.node].call("load", keys=list(x.keys),
                                                    offset=step.held[x.area][1][0] + x.first_block * fb,
                                                    timeout_s=self.timeout_s)
        except ControlError as e:
            dead = bool(self._dead(x.node))
            if dead and x.node == step.plan.de_node:
                raise  # its buffer is gone with it: the request must start over elsewhere
            self.faults.load_failed(rec, x.node, set(), self._now(), f"load on {x.node} failed ({e}): recomputed", dead)
            return 0
        if res.get("failed_at", -1) < 0:
            self.faults.load_ok(x.node, self._now())
            if res.get("retries"):
                self.faults.store_retried(rec, x.node, self._now(), f"load on {x.node} retried the store")
            return len(x.keys)
        errors = res.get("errors", {})
        codes = {v.split(":", 1)[0] for v in errors.values()}
        for k, v in errors.items():
            if v.startswith(("missing", "corrupt")):
                self.index.discard(k)
        self.faults.load_failed(rec, x.node, codes, self._now(),
                                f"{len(errors)} block(s) on {x.node} unreadable ({', '.join(sorted(codes))}): "
                                f"recomputed from block {x.first_block + res['failed_at']}", False)
        return res["failed_at"]

    async def _prefill(self, step: Prefill) -> PrefillJob:
        """Queue the request on its PE; returns once its last pass is done."""
        plan, held = step.plan, step.held
        dst = Span(plan.de_node, "buf", held["de"][1][0]) if plan.moves_kv else None
        reads = tuple(PastRead(Span(held[p.area][0].node, "buf", held[p.area][1][0]), p.first, p.n) for p in plan.past)
        fut = asyncio.get_running_loop().create_future()

        def done(job: PrefillJob, error: StepError | None) -> None:
            fut.set_exception(error) if error is not None else fut.set_result(job)

        job = PrefillJob(step.rec, plan, step.rid, step.rec.n_hit, done, io=(reads, dst))
        pe = plan.route.pe
        if self.batcher.push(pe, job):
            self._passes[pe] = asyncio.ensure_future(run_async(self.batcher.passes_of(pe), self._perform, _SURVIVABLE))
        return await fut

    async def _next_instant(self, step: NextInstant) -> None:
        await asyncio.sleep(0)

    async def _run_pass(self, step: RunPass) -> PassOutcome:
        """One forward pass on the PE: every job's next pass in one prefill_batch."""
        msgs = [self._pass_msg(j, e.new) for j, e in zip(step.jobs, step.batch.entries)]
        rep = await self.c.clients[step.engine].call("prefill_batch", requests=msgs, timeout_s=self.timeout_s)
        tm = rep["timing"]
        results = [PassResult(first_token=r["first_token"], attention_s=r["compute_cpu_s"], read_wait_s=r["read_wait_s"],
                              reread_bytes=r.get("reread_bytes", 0), crcs=r["write_crcs"],
                              layer_hashes=r.get("layer_hashes", []), peak_hit_bytes=r.get("peak_hit_bytes", 0),
                              connector=r.get("connector", "")) for r in rep["results"]]
        # the pass's compute in the engines' time: the target's when emulated
        record = {"attention_s": tm["emulated_s"] if tm["held_s"] else rep["attention_s"],
                  "attention_cpu_s": rep["attention_s"], "attention_wall_s": rep["attention_wall_s"],
                  "predicted_s": step.batch.predicted_s, "timing": tm}
        return PassOutcome(rep["t_end"] - self.c.clock_offset(step.engine) - self.t0, results, record)

    @staticmethod
    def _pass_msg(job: PrefillJob, n_new: int) -> dict:
        """The prefill_batch entry of a job's next pass. A later chunk reads its whole past from
        the DE buffer: the hits are there (read or forwarded) and so are earlier chunks."""
        first_reads, dst = job.io
        first, plan, prompt = job.first, job.plan, job.rec.prompt
        reads = first_reads if first else (PastRead(dst, 0, job.n_past),)
        return dict(request=job.rid, tokens=prompt[job.n_past:job.n_past + n_new],
                    n_past=job.n_past, mode=plan.connector, reads=[r.to_msg() for r in reads],
                    forward_past=plan.forward_past if first else 0,
                    past_crcs=None if first else job.crcs, tag=f"/c{job.passes}",
                    last=job.n_past + n_new == len(prompt),
                    dst=dst.to_msg() if dst else None)

    async def _await_layers(self, step: AwaitLayers) -> None:
        """The notifications follow the PE's WRITEs: when they are in, the layers have landed."""
        plan = step.plan
        await self.c.jobs[plan.de_node].call(
            "wait_notifs", peer=plan.route.pe,
            msgs=[m for t in step.job.tags for m in plan.layer_notifs(t, self.geom.n_layer)], timeout_s=self.timeout_s)

    async def _decode(self, step: Decode) -> DecodeOutcome:
        """The request's decode on its DE, from the KV at `src`, writing Full Blocks to `wb`."""
        plan, job = step.plan, step.job
        t0 = self.t0 + self.c.clock_offset(plan.route.de)  # the run's origin on the DE's clock
        src = Span(plan.de_node, "buf", step.src[0]) if step.src is not None else None
        wb = Span(plan.de_node, "buf", step.wb[0]) if step.wb is not None else None
        dec = await self.c.jobs[plan.route.de].call(
            "decode", request=step.rid, n_prompt=plan.n_prompt, first_token=job.first_token,
            t_first_token=job.t_first_token + t0, gen_len=plan.gen_len, src=src.to_msg() if src else None,
            wb=wb.to_msg() if wb else None, first_new_block=plan.first_new_block,
            expect_crcs=job.crcs if plan.moves_kv else None, timeout_s=self.timeout_s)
        return DecodeOutcome(tokens=dec["tokens"], token_times=[round(t - t0, 6) for t in dec["token_times"]],
                             written_blocks=dec.get("written_blocks", []), block_crcs=dec.get("block_crcs", []),
                             reread_bytes=dec["reread_bytes"], layer_hashes=dec["layer_hashes"],
                             connector=dec.get("connector", ""))

    async def _write_back(self, step: WriteBack) -> list[bool]:
        """Persist the Full Blocks decode wrote into the wb area once their notifications arrived."""
        rec, plan, keys, c = step.rec, step.plan, list(step.keys), self.c
        blocks = step.decoded.written_blocks
        await c.jobs[plan.de_node].call("wait_notifs", peer=plan.route.de, msgs=[plan.writeback_notif(b) for b in blocks],
                                        timeout_s=self.timeout_s)
        nbytes = len(keys) * self.geom.full_block_bytes
        ahead = sum(self._flushing.values())  # every node's writes share the storage servers' NICs
        self._flushing[plan.de_node] = self._flushing.get(plan.de_node, 0) + nbytes
        try:
            res = await c.jobs[plan.de_node].call("flush", keys=keys, offset=step.wb[0], crcs=step.decoded.block_crcs,
                                                  timeout_s=flush_timeout_s(self.timeout_s, ahead + nbytes,
                                                                            self._write_bps))
        finally:
            self._flushing[plan.de_node] -= nbytes
        took = list(res.get("stored", [True] * len(keys)))
        kept = [k for k, ok in zip(keys, took) if ok]
        if len(kept) < len(keys):  # not persisted: later turns recompute those blocks
            codes = {v.split(":", 1)[0] for v in res.get("errors", {}).values()}
            self.faults.flush_failed(rec, plan.de_node, codes, self._now(),
                                     f"{len(keys) - len(kept)} of {len(keys)} blocks not persisted "
                                     f"({', '.join(sorted(codes))}): recomputed by later turns")
        elif res.get("retries"):
            self.faults.store_retried(rec, plan.de_node, self._now(), "write-back retried the store")
        self.faults.stored(kept, self._now())
        return took

    async def _after_failure(self, step: AfterFailure) -> bool:
        """A request that failed starts over when a process it depended on died (the PE's host
        agent too: a PE-side read from its buffer dies with it, and the retry reads by the DE
        path, the scheduler seeing that node's SNIC down)."""
        route, c = step.route, self.c
        if step.rid:  # the attempt is over: its engines must stop counting it, whatever comes next
            await self.router.release(step.rid, route.pe, route.de)
        dead = self._dead(route.pe, route.de, c.host_of(route.de), c.host_of(route.pe))
        if isinstance(step.error.cause, ControlError) and dead:
            self.faults.process_died(step.rec, dead[0], self._now(), f"{dead[0]} exited during the request: retried")
            return True
        return False

    async def _gave_up(self, step: GaveUp) -> str:
        if not self.faults:
            return ""
        self.faults.failed(step.rec, self._now())
        return self.faults.label_of(step.rec)

    # -- trajectories --------------------------------------------------------------------------
    async def trajectory(self, tr: Trajectory, start_at: float = 0.0) -> list[RequestRecord]:
        """One agent's turns, each after the previous one's output (tool calls take no time, as
        in the paper's replay), from `start_at` (testbed s since the conductor's start) on; a
        replayed trace's turn also not before its own time (`Turn.at_s` after `start_at`)."""
        if (wait := start_at - self._now()) > 0:  # online: the agent arrives later
            await asyncio.sleep(wait)
        generated: list[list[int]] = []
        out = []
        for t, turn in enumerate(tr.turns):
            if turn.at_s is not None and (wait := start_at + turn.at_s - self._now()) > 0:
                await asyncio.sleep(wait)
            rec = RequestRecord(f"{self.mode}-t{tr.id}-r{t}", tr.id, t, self.mode, "")
            rec = await self.request(rec, tr.prompt(t, generated), turn.gen_len)
            out.append(rec)
            if rec.error:
                break  # the trajectory cannot go on without this turn's output
            generated.append(rec.tokens)
        return out

    async def warm(self, prompt: list[int], n: int = 0) -> RequestRecord:
        """Persist a prompt's blocks before the mode's first request (the shared system prompt,
        or a replayed trace's shared prefixes): a real request through the cluster."""
        rec = RequestRecord(f"{self.mode}-warmup" + (f"{n}" if n else ""), -1, n, self.mode, "")
        return await self.request(rec, list(prompt), 1)
