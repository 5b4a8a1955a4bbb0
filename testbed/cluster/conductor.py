"""The conductor: drives trajectories through the cluster in one mode, request by request.

Per request (DESIGN.md section 7): find the stored prefix (hit blocks), ask the
router for a prefill engine, a decode engine and a read path, read the hit Full
Blocks into that path's DRAM buffer (or part into each, split), run layerwise
prefill on the PE (which reads the past KV and writes KV to the DE buffer
through its connector), decode on the DE, and persist the newly filled Full
Blocks. Trajectories run concurrently; each process serves one command at a
time, so queues form where a real cluster's would.

Prefill goes through a per-PE queue. Each forward pass is packed under the
compute quota by the cost model (the target GPU's on an emulated clock, the
engine's own fit on the CPU's) and the request that would overflow it is
chunked (dualpath.scheduler.batching); a later chunk reads its past, hits and
earlier chunks, back from the DE buffer. Decode engines batch every ready
request themselves; the conductor keeps one decode outstanding per request.

Faults (testbed/cluster/faults.py): a request whose engines or DE host agent die under it starts over
as a new request to the scheduler (which no longer offers them), at most MAX_ATTEMPTS times; hit
blocks that cannot be read (corrupt, missing, their server or the node's SNIC down, the node's
host agent gone) are recomputed from the first of them, and its write-back repairs them; a
write-back the store refuses (a full disk) leaves the request complete and its blocks unstored.
What each request met is charged to the fault that explains it (FaultLog).

Timestamps are the host's monotonic clock (shared by every process on this
machine) minus the mode's start: testbed seconds. On an emulated clock one
emulated second lasts `dilation` of them.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, fields, replace
from typing import Callable

from dualpath.kv.buffers import ByteAllocator, OutOfSpace
from dualpath.control import ControlError
from dualpath.kv.connector import PastRead
from dualpath.kv.plan import Area, Load, RequestPlan, match_prefix, plan_request
from dualpath.kv.spans import Span, kv_bytes
from dualpath.lifecycle.record import RequestRecord
from dualpath.kv.layouts import BlockGeometry
from dualpath.scheduler.batching import PrefillQueue
from dualpath.scheduler.cost_model import AttentionCostModel
from dualpath.scheduler.records import Request
from dualpath.store.keys import chain_keys
from dualpath.workload import Trajectory
from testbed.cluster.processes import Cluster
from testbed.cluster.faults import FaultLog
from testbed.cluster.modes import MODES, connector_of  # MODES is re-exported here
from testbed.cluster.scheduling import Router
from dualpath.timeouts import scaled

MAX_ATTEMPTS = 3  # tries of one request while processes die under it


# What one attempt at a request produces (reset before each): everything but who it is, its
# prompt, arrival, the attempts and the faults it met.
_ATTEMPT_FIELDS = {f.name: (f.default_factory() if callable(f.default_factory) else f.default)
                   for f in fields(RequestRecord)
                   if f.name not in ("request", "trajectory", "turn", "mode", "path", "prompt", "n_prompt", "gen_len",
                                     "t_arrive", "attempts", "faults")}


@dataclass
class PrefillJob:
    """A request's prefill, pass by pass: what the next pass reads and what the passes returned."""

    rec: RequestRecord
    plan: RequestPlan
    prompt: list[int]
    first_reads: tuple[PastRead, ...]
    dst: Span | None  # the request's area in the DE buffer
    fut: asyncio.Future
    n_past: int = 0  # past tokens: the hits, then also the chunks done
    crcs: list[int] | None = None  # per layer, of rows [0, n_past) as the last pass wrote them
    tags: list[str] = field(default_factory=list)
    first_token: int = -1
    t_first_token: float = 0.0  # host clock: the end of the pass that produced it
    rid: str = ""  # the request's id for this attempt (the record's, or with a retry suffix)

    def __post_init__(self) -> None:
        self.rid = self.rid or self.rec.request

    def next_pass(self, n_new: int) -> dict:
        """The prefill_batch entry of this job's next pass. A later chunk reads its whole past
        from the DE buffer: the hits are there (read or forwarded) and so are earlier chunks."""
        first = not self.tags
        tag = f"/c{len(self.tags)}"
        self.tags.append(tag)
        reads = self.first_reads if first else (PastRead(self.dst, 0, self.n_past),)
        return dict(request=self.rid, tokens=self.prompt[self.n_past:self.n_past + n_new],
                    n_past=self.n_past, mode=self.plan.connector, reads=[r.to_msg() for r in reads],
                    forward_past=self.plan.forward_past if first else 0,
                    past_crcs=None if first else self.crcs, tag=tag,
                    last=self.n_past + n_new == len(self.prompt),
                    dst=self.dst.to_msg() if self.dst else None)

    def absorb(self, res: dict, n_new: int, geom: BlockGeometry) -> None:
        r = self.rec
        if len(self.tags) == 1:  # the first pass loaded the stored hits: what verification checks
            r.pe_layer_hashes, r.peak_hit_bytes = res["layer_hashes"], res["peak_hit_bytes"]
            r.connectors = (res.get("connector", ""), r.connectors[1])
        else:
            r.chunk_read_bytes += kv_bytes(geom, self.n_past)
        r.chunk_read_bytes += res.get("reread_bytes", 0)
        r.read_wait_s += res["read_wait_s"]
        r.attention_s += res["compute_cpu_s"]
        r.passes += 1
        self.crcs = res["write_crcs"]
        self.n_past += n_new
        self.first_token = res["first_token"]


class Conductor:
    def __init__(self, cluster: Cluster, geom: BlockGeometry, mode: str, namespace: bytes, router: Router,
                 request_timeout_s: float = scaled(120.0), on_record: Callable[[RequestRecord], None] | None = None,
                 cost_model: AttentionCostModel | None = None, quota_s: float = 0.3,
                 faults: FaultLog | None = None):
        """`cost_model` packs the PEs' passes under `quota_s` (both in the engines' time: the
        target's seconds on an emulated clock); None packs every waiting request into one pass."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
        self.c, self.geom, self.mode, self.ns = cluster, geom, mode, namespace
        self.timeout_s = request_timeout_s
        self.on_record = on_record or (lambda r: None)
        self.stored: set[str] = set()  # blocks a request may count as hits
        self.persisted: set[str] = set()  # blocks the store acknowledged (oracle: none)
        self.faults = faults if faults is not None else FaultLog()
        self.buffers = {n: ByteAllocator(cluster.buffer_bytes, f"{n} DRAM buffer", align=64)
                        for n, p in cluster.procs.items() if p.role == "host"}
        self._space = asyncio.Condition()
        self.router = router
        self.connector = connector_of(mode)
        self.cost_model, self.quota_s = cost_model or AttentionCostModel(), quota_s
        self._queues: dict[str, PrefillQueue] = {}  # per PE: its waiting prefill work, chunk by chunk
        self._jobs: dict[str, PrefillJob] = {}
        self._batchers: dict[str, asyncio.Future] = {}
        self.batches: list[dict] = []  # one per forward pass: engine, times, attention seconds
        self.t0 = time.monotonic()

    # -- buffers -------------------------------------------------------------------------------
    async def _alloc(self, area: Area) -> int:
        """Space for an area in its node's DRAM buffer; waits (bounded) for others to free some."""
        deadline = time.monotonic() + self.timeout_s
        async with self._space:
            while True:
                try:
                    return self.buffers[area.node].alloc(area.blocks * self.geom.full_block_bytes)
                except OutOfSpace:
                    if time.monotonic() > deadline:
                        raise
                    try:
                        await asyncio.wait_for(self._space.wait(), timeout=0.5)
                    except asyncio.TimeoutError:
                        pass

    async def _free(self, node: str, off: int | None) -> None:
        if off is None:
            return
        async with self._space:
            self.buffers[node].free(off)
            self._space.notify_all()

    # -- one request ---------------------------------------------------------------------------
    async def request(self, rec: RequestRecord, prompt: list[int], gen_len: int) -> RequestRecord:
        """One turn, retried (as a new request to the scheduler) while a process it depended on
        died under it, at most MAX_ATTEMPTS times and not after request_timeout_s; an error
        names the request and the faults it met."""
        rec.t_arrive = self._now()
        rec.prompt, rec.gen_len, rec.n_prompt = prompt, gen_len, len(prompt)
        give_up = rec.t_arrive + self.timeout_s
        for attempt in range(MAX_ATTEMPTS):
            rec.attempts = attempt + 1
            rid = rec.request if attempt == 0 else f"{rec.request}~{attempt}"
            if not await self._attempt(rec, rid, prompt, gen_len):
                break
            if attempt + 1 == MAX_ATTEMPTS or self._now() > give_up:
                rec.error = f"gave up after {attempt + 1} attempts: {rec.error}"
                break
        if rec.error:
            if self.faults:
                self.faults.failed(rec, self._now())
            met = self.faults.label_of(rec) if self.faults else ""
            if not rec.error.startswith(f"request {rec.request}"):
                rec.error = f"request {rec.request}: {rec.error}"
            if met:
                rec.error += f" (fault {met})"
        self.on_record(rec)
        return rec

    def _hits(self, rec: RequestRecord, n_hit_blocks: int) -> None:
        g = self.geom
        rec.n_hit = n_hit_blocks * g.block_size
        rec.n_miss = rec.n_prompt - rec.n_hit
        rec.hit_bytes, rec.miss_bytes = kv_bytes(g, rec.n_hit), kv_bytes(g, rec.n_miss)

    def _dead(self, *names: str) -> list[str]:
        return [n for n in names if n and not self.c.procs[n].alive()]

    async def _attempt(self, rec: RequestRecord, rid: str, prompt: list[int], gen_len: int) -> bool:
        """One try at a request; True: try again (a process it depended on died), with
        rec.error saying why. Without faults the first try is the only one."""
        g, c = self.geom, self.c
        for name, value in _ATTEMPT_FIELDS.items():  # what an earlier try produced is gone
            setattr(rec, name, list(value) if isinstance(value, list) else value)
        keys, n_hit_blocks = match_prefix(prompt, self.stored, g, self.ns)
        self._hits(rec, n_hit_blocks)
        try:
            route = await self.router.route(Request(rid, len(prompt), rec.n_hit, rec.n_miss, self._now()),
                                            self.timeout_s)
        except (asyncio.TimeoutError, ControlError) as e:
            rec.error = str(e) or f"no engine admitted the request within {self.timeout_s:g} s"
            rec.t_done = self._now()
            return False
        rec.t_routed = self._now()
        rec.pe, rec.de = route.pe, route.de
        de_host = c.host_of(route.de)
        if dead := self._dead(route.pe, route.de, de_host):  # decided before it died
            rec.error = f"{dead[0]} exited"
            self.faults.process_died(rec, dead[0], self._now(), f"routed to {dead[0]}, which had exited: retried")
            return True
        if route.avoided:
            self.faults.avoided(rec, route.avoided, self._now())
        plan = plan_request(rid, prompt, gen_len, keys, n_hit_blocks, route, g, self.connector,
                            c.host_of(route.pe), de_host)
        held: dict[str, tuple[str, int]] = {}  # area name -> (node, offset) while allocated
        try:
            for area in plan.areas:
                held[area.name] = (area.node, await self._alloc(area))
            off = {name: o for name, (_, o) in held.items()}
            n_ok = await self._read_hits(rec, plan, off)
            if n_ok < plan.n_hit_blocks:  # the rest of the hits is recomputed: a plan with fewer
                plan = plan_request(rid, prompt, gen_len, keys, n_ok,
                                    replace(route, pe_blocks=min(route.pe_blocks, n_ok)), g, self.connector,
                                    plan.pe_node, plan.de_node)
                self._hits(rec, n_ok)
            rec.path = route.path if plan.moves_kv else "none"
            rec.pe_node, rec.de_node = plan.pe_node, plan.de_node
            rec.pe_hit_bytes = kv_bytes(g, plan.pe_blocks * g.block_size)
            dst = Span(plan.de_node, "buf", off["de"]) if plan.moves_kv else None
            reads = tuple(PastRead(Span(held[p.area][0], "buf", off[p.area]), p.first, p.n) for p in plan.past)
            rec.t_prefill_start = self._now()
            job = await self._prefill(rec.pe, PrefillJob(rec, plan, prompt, reads, dst,
                                                         asyncio.get_running_loop().create_future(), n_past=rec.n_hit,
                                                         rid=rid))
            rec.t_first_token = job.t_first_token - self.t0
            if plan.moves_kv:  # the notifications follow the PE's WRITEs: then the layers have landed
                await c.jobs[plan.de_node].call(
                    "wait_notifs", peer=rec.pe, msgs=[m for t in job.tags for m in plan.layer_notifs(t, g.n_layer)],
                    timeout_s=self.timeout_s)
            if "pe" in held:
                await self._free(*held.pop("pe"))
            wb = None
            if plan.moves_kv and plan.writeback is not None:
                held["wb"] = (plan.de_node, await self._alloc(plan.writeback))
                wb = Span(plan.de_node, "buf", held["wb"][1])
            dec = await self._decode(rec, rid, len(prompt), gen_len, plan, job, dst, wb)
            if "de" in held:
                await self._free(*held.pop("de"))
            await self._write_back(rec, plan, prompt, dec, held.get("wb"))
            rec.t_done = self._now()
            rec.error = ""
        except (ControlError, OutOfSpace) as e:
            rec.error = str(e)
            rec.t_done = self._now()
            # the PE's host agent too: a PE-side read from its buffer dies with it, and the retry
            # reads by the DE path (the scheduler sees that node's SNIC down)
            dead = self._dead(route.pe, route.de, de_host, c.host_of(route.pe))
            if isinstance(e, ControlError) and dead:
                self.faults.process_died(rec, dead[0], self._now(), f"{dead[0]} exited during the request: retried")
                return True
        finally:
            for node, o in held.values():
                await self._free(node, o)
        return False

    async def _decode(self, rec: RequestRecord, rid: str, n_prompt: int, gen_len: int, plan: RequestPlan,
                      job: PrefillJob, src: Span | None, wb: Span | None) -> dict:
        """The request's decode on its DE, from the KV at `src`, writing Full Blocks to `wb`."""
        dec = await self.c.jobs[rec.de].call(
            "decode", request=rid, n_prompt=n_prompt, first_token=job.first_token,
            t_first_token=job.t_first_token, gen_len=gen_len, src=src.to_msg() if src else None,
            wb=wb.to_msg() if wb else None, first_new_block=plan.first_new_block,
            expect_crcs=job.crcs if plan.moves_kv else None, timeout_s=self.timeout_s)
        rec.reread_bytes = dec["reread_bytes"]
        rec.tokens, rec.de_layer_hashes = dec["tokens"], dec["layer_hashes"]
        rec.connectors = (rec.connectors[0], dec.get("connector", ""))
        rec.token_times = [round(t - self.t0, 6) for t in dec["token_times"]]
        return dec

    async def _write_back(self, rec: RequestRecord, plan: RequestPlan, prompt: list[int], dec: dict,
                          wb: tuple[str, int] | None) -> None:
        """Persist the Full Blocks the decode engine wrote into the write-back area `wb` (node,
        offset) once their notifications arrived; a plan that moves no KV stores them as if written."""
        g, c = self.geom, self.c
        all_keys = chain_keys(prompt + rec.tokens[:-1], g.block_size, namespace=self.ns)  # KV that exists
        if not plan.moves_kv:
            self.stored.update(all_keys)  # as if written back, with no I/O
            return
        if not dec["written_blocks"]:
            return
        written = [all_keys[b] for b in dec["written_blocks"]]
        await c.jobs[plan.de_node].call(
            "wait_notifs", peer=rec.de, msgs=[plan.writeback_notif(b) for b in dec["written_blocks"]],
            timeout_s=self.timeout_s)
        res = await c.jobs[plan.de_node].call("flush", keys=written, offset=wb[1],
                                              crcs=dec["block_crcs"], timeout_s=self.timeout_s)
        rec.writeback_bytes = len(written) * g.full_block_bytes
        kept = [k for k, ok in zip(written, res.get("stored", [True] * len(written))) if ok]
        if len(kept) < len(written):  # not persisted: later turns recompute those blocks
            codes = {v.split(":", 1)[0] for v in res.get("errors", {}).values()}
            self.faults.flush_failed(rec, plan.de_node, codes, self._now(),
                                     f"{len(written) - len(kept)} of {len(written)} blocks not persisted "
                                     f"({', '.join(sorted(codes))}): recomputed by later turns")
        elif res.get("retries"):
            self.faults.store_retried(rec, plan.de_node, self._now(), "write-back retried the store")
        self.stored.update(kept)
        self.persisted.update(kept)
        self.faults.stored(kept, self._now())

    async def _read_hits(self, rec: RequestRecord, plan: RequestPlan, off: dict[str, int]) -> int:
        """The plan's loads from the store, every side at once (a split reads both). Returns how
        many leading hit blocks are in place: a block that could not be read (missing, corrupt,
        its server or the node's SNIC down, the node's host agent gone) and all after it are
        recomputed instead; a missing or corrupt one is no longer counted as stored (its
        write-back by this request repairs it)."""
        fb = self.geom.full_block_bytes

        async def load(x: Load) -> int:
            try:
                res = await self.c.loaders[x.node].call("load", keys=list(x.keys), offset=off[x.area] + x.first_block * fb,
                                                        timeout_s=self.timeout_s)
            except ControlError as e:
                dead = bool(self._dead(x.node))
                if dead and x.node == plan.de_node:
                    raise  # its buffer is gone with it: the request must start over elsewhere
                self.faults.load_failed(rec, x.node, set(), self._now(),
                                        f"load on {x.node} failed ({e}): recomputed", dead)
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
                    self.stored.discard(k)
            self.faults.load_failed(rec, x.node, codes, self._now(),
                                    f"{len(errors)} block(s) on {x.node} unreadable ({', '.join(sorted(codes))}): "
                                    f"recomputed from block {x.first_block + res['failed_at']}", False)
            return res["failed_at"]

        if not plan.loads:
            return plan.n_hit_blocks
        rec.t_read_start = self._now()
        got = await asyncio.gather(*(load(x) for x in plan.loads))
        rec.t_read_end = self._now()
        n_ok = plan.n_hit_blocks
        for x, k in zip(plan.loads, got):
            if k < len(x.keys):
                n_ok = min(n_ok, x.first_block + k)
        return n_ok

    def _now(self) -> float:
        return time.monotonic() - self.t0

    # -- intra-engine batching -----------------------------------------------------------------
    async def _prefill(self, pe: str, job: PrefillJob) -> PrefillJob:
        """Queue the job on its PE; returns once its last pass is done."""
        q = self._queues.setdefault(pe, PrefillQueue(self.cost_model, self.quota_s))
        q.push(job.rid, job.n_past, len(job.prompt) - job.n_past)
        self._jobs[job.rid] = job
        if pe not in self._batchers:
            self._batchers[pe] = asyncio.ensure_future(self._batcher(pe))
        return await job.fut

    async def _batcher(self, pe: str) -> None:
        """Runs the PE's forward passes while it has waiting work, FIFO, packed under the quota."""
        q = self._queues[pe]
        while len(q):
            await asyncio.sleep(0)  # requests arriving in this same instant join the pass
            batch = q.next_batch()
            jobs = [self._jobs[e.request_id] for e in batch.entries]
            # Loaded: work is left over for the next pass (the quota, not the queue, ended this one).
            loaded = len(q) > 0
            msgs = [j.next_pass(e.new) for j, e in zip(jobs, batch.entries)]
            t0 = self._now()
            try:
                rep = await self.c.clients[pe].call("prefill_batch", requests=msgs, timeout_s=self.timeout_s)
            except ControlError as e:
                for j, entry in zip(jobs, batch.entries):
                    if not entry.last:
                        q.drop(entry.request_id)
                    del self._jobs[entry.request_id]
                    j.fut.set_exception(e)
                continue
            tm = rep["timing"]
            self.batches.append({"pe": pe, "t_start": t0, "t_end": self._now(), "n": len(batch.entries),
                                 "chunked": not batch.entries[-1].last, "loaded": loaded,
                                 # the pass's compute in the engines' time: the target's when emulated
                                 "attention_s": tm["emulated_s"] if tm["held_s"] else rep["attention_s"],
                                 "attention_cpu_s": rep["attention_s"], "attention_wall_s": rep["attention_wall_s"],
                                 "predicted_s": batch.predicted_s, "timing": tm})
            for j, e, res in zip(jobs, batch.entries, rep["results"]):
                j.absorb(res, e.new, self.geom)
                if e.last:
                    j.t_first_token = rep["t_end"]
                    del self._jobs[e.request_id]
                    j.fut.set_result(j)
        del self._batchers[pe]

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
