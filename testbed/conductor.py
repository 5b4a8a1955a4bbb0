"""The conductor: drives trajectories through the cluster in one mode, request by request.

Per request (DESIGN.md section 7): find the stored prefix (hit blocks), pick a
prefill engine, a decode engine and a read path, read the hit Full Blocks into
that path's DRAM buffer, run layerwise prefill on the PE (which reads hit KV
and writes KV to the DE buffer through its connector), decode on the DE, and
persist the newly filled Full Blocks. Trajectories run concurrently; each
process serves one command at a time, so queues form where a real cluster's
would.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from dualpath.buffers import ByteAllocator, OutOfSpace
from dualpath.control import ControlError
from dualpath.kv_spans import Span, kv_bytes
from dualpath.layouts import BlockGeometry
from dualpath.scheduler.records import Request
from dualpath.store.keys import chain_keys
from testbed.cluster import Cluster

MODES = ("basic", "layerwise", "dualpath", "dualpath-rr", "oracle")
PATHS = ("pe", "de")


@dataclass
class RequestRecord:
    request: str
    trajectory: int
    turn: int
    mode: str
    path: str  # "pe", "de" or "none" (oracle)
    pe: str = ""
    de: str = ""
    pe_node: str = ""
    de_node: str = ""
    n_prompt: int = 0
    n_hit: int = 0
    n_miss: int = 0
    gen_len: int = 0
    hit_bytes: int = 0  # H
    miss_bytes: int = 0  # M
    writeback_bytes: int = 0  # W
    prompt: list[int] = field(default_factory=list, repr=False)
    tokens: list[int] = field(default_factory=list)
    pe_layer_hashes: list[str] = field(default_factory=list, repr=False)
    de_layer_hashes: list[str] = field(default_factory=list, repr=False)
    peak_hit_bytes: int = 0
    t_arrive: float = 0.0
    t_read_start: float = 0.0
    t_read_end: float = 0.0
    t_prefill_start: float = 0.0
    t_first_token: float = 0.0
    t_done: float = 0.0
    read_wait_s: float = 0.0
    reread_bytes: int = 0  # KV read again by the DE because the PE's WRITE had not landed yet
    attention_s: float = 0.0  # the PE's layer compute time for this request
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("prompt")
        return d


class PathChooser:
    """Which side reads a request's hit KV when no scheduler decides: fixed per mode, or
    alternating."""

    def __init__(self, mode: str):
        self.mode = mode
        self._alt = itertools.cycle(PATHS)

    def __call__(self) -> str:
        if self.mode == "oracle":
            return "none"
        return next(self._alt) if self.mode.startswith("dualpath") else "pe"


class Conductor:
    def __init__(self, cluster: Cluster, geom: BlockGeometry, mode: str, namespace: bytes,
                 request_timeout_s: float = 120.0,
                 on_record: Callable[[RequestRecord], None] | None = None, policy=None,
                 cost_model=None, quota_s: float = 0.3):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
        self.c, self.geom, self.mode, self.ns = cluster, geom, mode, namespace
        self.choose_path = PathChooser(mode)
        self.timeout_s = request_timeout_s
        self.on_record = on_record or (lambda r: None)
        self.stored: set[str] = set()
        self.buffers = {n: ByteAllocator(cluster.buffer_bytes, f"{n} DRAM buffer", align=64)
                        for n, p in cluster.procs.items() if p.role == "host"}
        self._space = asyncio.Condition()
        self._pe = itertools.cycle(cluster.engines("prefill"))
        self._de = itertools.cycle(cluster.engines("decode"))
        self.policy = policy  # a dualpath.scheduler.live.LivePolicy, for the dualpath modes
        # With a cost model, PEs run quota-packed batches (the paper's intra-engine scheduling).
        self.cost_model, self.quota_s = cost_model, quota_s
        self._pe_waiting: dict[str, list] = {}
        self._batchers: dict[str, asyncio.Future] = {}
        self.batches: list[dict] = []  # one per forward batch: engine, times, attention seconds
        self.t0 = time.monotonic()

    # -- buffers -------------------------------------------------------------------------------
    async def _alloc(self, node: str, nbytes: int) -> int:
        """Space in a node's DRAM buffer; waits (bounded) for other requests to free some."""
        deadline = time.monotonic() + self.timeout_s
        async with self._space:
            while True:
                try:
                    return self.buffers[node].alloc(nbytes)
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
        g, c = self.geom, self.c
        bs, fb = g.block_size, g.full_block_bytes
        rec.t_arrive = self._now()
        rec.prompt, rec.gen_len, rec.n_prompt = prompt, gen_len, len(prompt)
        keys = chain_keys(prompt, bs, namespace=self.ns)
        n_hit_blocks = 0
        for k in keys[: (len(prompt) - 1) // bs]:  # at least one miss token produces the logits
            if k not in self.stored:
                break
            n_hit_blocks += 1
        rec.n_hit = n_hit_blocks * bs
        rec.n_miss = len(prompt) - rec.n_hit
        rec.hit_bytes, rec.miss_bytes = kv_bytes(g, rec.n_hit), kv_bytes(g, rec.n_miss)
        sreq = Request(rec.request, len(prompt), rec.n_hit, rec.n_miss, rec.t_arrive)
        if self.policy is not None:
            deadline = time.monotonic() + self.timeout_s
            while (choice := self.policy.choose(sreq)) is None:  # every PE overloaded: wait (FIFO)
                if time.monotonic() > deadline:
                    rec.error = "no engine admitted the request in time"
                    self.on_record(rec)
                    return rec
                await asyncio.sleep(0.005)
            rec.pe, rec.de, path = choice
            rec.path = path.value
        else:
            rec.path = self.choose_path()
            rec.pe, rec.de = next(self._pe), next(self._de)
        rec.pe_node, rec.de_node = c.host_of(rec.pe), c.host_of(rec.de)
        oracle = self.mode == "oracle"
        n_blocks = g.blocks_spanned(len(prompt))  # the area holds the partial tail block too
        n_wb = (len(prompt) + gen_len - 1) // bs - n_hit_blocks
        de_off = pe_off = wb_off = None
        prefill_counted = False
        try:
            src = None
            if not oracle:
                de_off = await self._alloc(rec.de_node, n_blocks * fb)
                dst = Span(rec.de_node, "buf", de_off)
                src_node = rec.pe_node if rec.path == "pe" else rec.de_node
                if n_hit_blocks:
                    if rec.path == "pe":
                        pe_off = await self._alloc(rec.pe_node, n_hit_blocks * fb)
                        src = Span(rec.pe_node, "buf", pe_off)
                    else:
                        src = dst  # the DE path reads into the request's own area of the DE buffer
                    if self.policy is not None:
                        self.policy.read_queued(src_node, n_hit_blocks * fb)
                    try:
                        rec.t_read_start = self._now()
                        await c.clients[src_node].call("load", keys=keys[:n_hit_blocks], offset=src.offset,
                                                       timeout_s=self.timeout_s)
                        rec.t_read_end = self._now()
                    finally:
                        if self.policy is not None:
                            self.policy.read_done(src_node, n_hit_blocks * fb)
            rec.t_prefill_start = self._now()
            pre = await self._prefill(rec.pe, dict(
                request=rec.request, tokens=prompt[rec.n_hit:], n_hit=rec.n_hit,
                mode=("oracle" if oracle else "basic" if self.mode == "basic" else "layerwise"),
                write=("all" if rec.path == "pe" else "miss"),
                src=src.to_msg() if src else None, dst=None if oracle else dst.to_msg()))
            rec.t_first_token = self._now()
            rec.attention_s = pre["compute_s"]
            if self.policy is not None:  # tok_e counts unfinished prefill work only
                self.policy.prefill_done(rec.pe, sreq)
                prefill_counted = True
            if not oracle:  # the notifications follow the PE's WRITEs: then the layers have landed
                await c.clients[rec.de_node].call(
                    "wait_notifs", peer=rec.pe, msgs=[f"{rec.request}/L{l}" for l in range(g.n_layer)],
                    timeout_s=self.timeout_s)
            rec.pe_layer_hashes, rec.peak_hit_bytes = pre["layer_hashes"], pre["peak_hit_bytes"]
            rec.read_wait_s = pre["read_wait_s"]
            await self._free(rec.pe_node, pe_off)
            pe_off = None
            wb = None
            if not oracle and n_wb > 0:
                wb_off = await self._alloc(rec.de_node, n_wb * fb)
                wb = Span(rec.de_node, "buf", wb_off)
            dec = await c.clients[rec.de].call(
                "decode", request=rec.request, n_prompt=len(prompt), first_token=pre["first_token"],
                gen_len=gen_len, src=None if oracle else dst.to_msg(), wb=wb.to_msg() if wb else None,
                first_new_block=n_hit_blocks, expect_crcs=None if oracle else pre["write_crcs"],
                crc_from=0 if rec.path == "pe" else rec.n_hit, timeout_s=self.timeout_s)
            rec.reread_bytes = dec["reread_bytes"]
            rec.tokens, rec.de_layer_hashes = dec["tokens"], dec["layer_hashes"]
            await self._free(rec.de_node, de_off)
            de_off = None
            with_kv = prompt + rec.tokens[:-1]  # the last token's KV is never computed
            all_keys = chain_keys(with_kv, bs, namespace=self.ns)
            if oracle:
                self.stored.update(all_keys)  # as if written back, with no I/O
            elif dec["written_blocks"]:
                written = [all_keys[b] for b in dec["written_blocks"]]
                await c.clients[rec.de_node].call(
                    "wait_notifs", peer=rec.de, msgs=[f"{rec.request}/wb{b}" for b in dec["written_blocks"]],
                    timeout_s=self.timeout_s)
                await c.clients[rec.de_node].call("flush", keys=written, offset=wb_off, crcs=dec["block_crcs"],
                                                   timeout_s=self.timeout_s)
                rec.writeback_bytes = len(written) * fb
                self.stored.update(written)
            rec.t_done = self._now()
        except (ControlError, OutOfSpace) as e:
            rec.error = str(e)
            rec.t_done = self._now()
        finally:
            if self.policy is not None:
                if not prefill_counted:
                    self.policy.prefill_done(rec.pe, sreq)
                self.policy.decode_done(rec.de, sreq)
            for node, off in ((rec.pe_node, pe_off), (rec.de_node, de_off), (rec.de_node, wb_off)):
                await self._free(node, off)
        self.on_record(rec)
        return rec

    def _now(self) -> float:
        return time.monotonic() - self.t0

    # -- intra-engine batching -----------------------------------------------------------------
    async def _prefill(self, pe: str, args: dict) -> dict:
        """Prefill one request: alone, or (with a cost model) in the PE's next quota-sized batch."""
        if self.cost_model is None:
            return await self.c.clients[pe].call("prefill", timeout_s=self.timeout_s, **args)
        fut = asyncio.get_running_loop().create_future()
        self._pe_waiting.setdefault(pe, []).append((args, fut))
        if pe not in self._batchers:
            self._batchers[pe] = asyncio.ensure_future(self._batcher(pe))
        return await fut

    async def _batcher(self, pe: str) -> None:
        """Packs the PE's waiting requests into forward batches under the compute quota."""
        waiting = self._pe_waiting[pe]
        while waiting:
            await asyncio.sleep(0)  # requests arriving in this same instant join the batch
            batch, used = [], self.cost_model.intercept
            while waiting:
                args, fut = waiting[0]
                cost = self.cost_model.request_cost(args["n_hit"], len(args["tokens"]))
                if batch and used + cost > self.quota_s:
                    break  # full: the rest waits for the next forward
                batch.append(waiting.pop(0))
                used += cost
            t0 = self._now()
            try:
                rep = await self.c.clients[pe].call("prefill_batch", requests=[a for a, _ in batch],
                                                    timeout_s=self.timeout_s)
            except ControlError as e:
                for _, fut in batch:
                    fut.set_exception(e)
                continue
            self.batches.append({"pe": pe, "t_start": t0, "t_end": self._now(), "n": len(batch),
                                 "attention_s": rep["attention_s"], "predicted_s": used})
            for (_, fut), res in zip(batch, rep["results"]):
                fut.set_result(res)
        del self._batchers[pe]

    # -- trajectories --------------------------------------------------------------------------
    async def trajectory(self, tid: int, system_prompt: list[int], turns: list[tuple[list[int], int]]
                         ) -> list[RequestRecord]:
        context = list(system_prompt)
        out = []
        for t, (append, gen_len) in enumerate(turns):
            rec = RequestRecord(f"{self.mode}-t{tid}-r{t}", tid, t, self.mode, "")
            rec = await self.request(rec, context + list(append), gen_len)
            out.append(rec)
            if rec.error:
                break  # the trajectory cannot go on without this turn's output
            context = rec.prompt + rec.tokens
        return out

    async def warm(self, system_prompt: list[int]) -> RequestRecord:
        """Persist the shared system prompt's blocks (a real request through the cluster)."""
        rec = RequestRecord(f"{self.mode}-warmup", -1, 0, self.mode, "")
        return await self.request(rec, list(system_prompt), 1)
