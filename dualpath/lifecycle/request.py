"""One request's lifecycle (DESIGN.md sections 7 and 10), written once for the testbed and the
simulator.

Per request: match the prompt's Full Blocks against the store's index (hit blocks), ask the
scheduler for a prefill engine, a decode engine and a read path, plan it
(dualpath.kv.plan.plan_request), take its areas in the nodes' DRAM buffers, load the hits into
them (a block that cannot be read, and all after it, is recomputed: a plan with fewer hits),
queue its prefill on the PE (prefill.py), wait for the layers the PE wrote toward the DE, decode,
write the newly filled Full Blocks back, and count what the store took as hits from then on.

A request whose processes die under it starts over as a new request to the scheduler, at most
MAX_ATTEMPTS times and not after the timeout; an error names the request and the fault that
explains it. The steps (steps.py) are what an executor performs; nothing here waits or does I/O.
"""
from __future__ import annotations

from collections.abc import Callable, Generator, Hashable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol

from dualpath.kv.plan import RequestPlan, Route, plan_request
from dualpath.lifecycle.index import StoreIndex
from dualpath.lifecycle.record import RequestRecord
from dualpath.lifecycle.steps import (AfterFailure, Allocate, AskRoute, AwaitLayers, Decode, DecodeOutcome,
                                      GaveUp, LoadHits, Prefill, Release, StepError, WriteBack)
from dualpath.scheduler.hbm import HbmPlan, NeverFits
from dualpath.scheduler.records import Request

MAX_ATTEMPTS = 3  # tries of one request while processes die under it

Steps = Generator[Any, Any, Any]

# What one attempt at a request produces (reset before each): everything but who it is, its
# prompt, arrival, the attempts and the faults it met.
_ATTEMPT_FIELDS = {f.name: (f.default_factory() if callable(f.default_factory) else f.default)
                   for f in fields(RequestRecord)
                   if f.name not in ("request", "trajectory", "turn", "mode", "path", "prompt", "n_prompt", "gen_len",
                                     "t_arrive", "attempts", "faults")}


class Geometry(Protocol):
    """What the lifecycle needs of the KV's shape (a BlockGeometry, or the simulator's config)."""

    block_size: int
    n_layer: int

    @property
    def kv_bytes_per_token(self) -> int: ...

    @property
    def full_block_bytes(self) -> int: ...

    def blocks_spanned(self, n_tokens: int) -> int: ...


@dataclass
class RequestLifecycle:
    """The lifecycle's fixed inputs: the cluster's shape and the executor's clock."""

    geom: Geometry
    connector: str  # "basic", "layerwise" or "oracle"
    index: StoreIndex
    host_of: Callable[[str], str]  # an engine's node
    now: Callable[[], float]
    timeout_s: float = float("inf")  # no new attempt after this long
    hbm: HbmPlan | None = None  # the target's HBM per engine (None: not limited)

    def request(self, rec: RequestRecord, prompt: Sequence[int], gen_len: int, keys: Sequence[Hashable],
                context_keys: Callable[[RequestRecord], Sequence[Hashable]]) -> Steps:
        """One turn, retried while a process it depended on died. `keys` are the prompt's Full
        Blocks' keys; `context_keys(rec)` after decode those of the prompt and its output (as
        far as the executor can name them): what a write-back stores."""
        rec.t_arrive = self.now()
        rec.gen_len, rec.n_prompt = gen_len, len(prompt)
        if self.hbm is not None:
            try:  # one that no engine could ever hold would wait for HBM forever
                self.hbm.check_request(rec.request, len(prompt), gen_len, self.connector)
            except NeverFits as e:
                rec.error, rec.t_done = str(e), self.now()
                return rec
        give_up = rec.t_arrive + self.timeout_s
        for attempt in range(MAX_ATTEMPTS):
            rec.attempts = attempt + 1
            rid = rec.request if attempt == 0 else f"{rec.request}~{attempt}"
            if not (yield from self._attempt(rec, rid, prompt, gen_len, keys, context_keys)):
                break
            if attempt + 1 == MAX_ATTEMPTS or self.now() > give_up:
                rec.error = f"gave up after {attempt + 1} attempts: {rec.error}"
                break
        if rec.error:
            met = yield GaveUp(rec)
            if not rec.error.startswith(f"request {rec.request}"):
                rec.error = f"request {rec.request}: {rec.error}"
            if met:
                rec.error += f" (fault {met})"
        return rec

    def _hits(self, rec: RequestRecord, n_hit_blocks: int) -> None:
        kvb = self.geom.kv_bytes_per_token
        rec.n_hit = n_hit_blocks * self.geom.block_size
        rec.n_miss = rec.n_prompt - rec.n_hit
        rec.hit_bytes, rec.miss_bytes = rec.n_hit * kvb, rec.n_miss * kvb

    def _attempt(self, rec: RequestRecord, rid: str, prompt: Sequence[int], gen_len: int,
                 keys: Sequence[Hashable], context_keys: Callable[[RequestRecord], Sequence[Hashable]]) -> Steps:
        """One try; returns True to try again (rec.error says why)."""
        for name, value in _ATTEMPT_FIELDS.items():  # what an earlier try produced is gone
            setattr(rec, name, list(value) if isinstance(value, list) else value)
        n_hit_blocks = self.index.match(keys, len(prompt), self.geom.block_size)
        self._hits(rec, n_hit_blocks)
        try:
            route: Route = yield AskRoute(Request(rid, len(prompt), rec.n_hit, rec.n_miss, self.now()), rec)
        except StepError as e:
            rec.error = str(e)
            if not e.retry:
                rec.t_done = self.now()
            return e.retry
        rec.t_routed = self.now()
        rec.pe, rec.de = route.pe, route.de
        plan = self._plan(rid, prompt, gen_len, keys, n_hit_blocks, route)
        held: dict[str, tuple[Any, Any]] = {}  # area name -> (area, handle) while allocated
        try:
            yield from self._run(rec, rid, prompt, plan, keys, held, context_keys)
            rec.error = ""
        except StepError as e:
            rec.error = str(e)
            rec.t_done = self.now()
            return (yield AfterFailure(rec, route, e, rid))
        finally:
            for area, handle in held.values():
                yield Release(area, handle)
        return False

    def _plan(self, rid: str, prompt: Sequence[int], gen_len: int, keys: Sequence[Hashable], n_hit_blocks: int,
              route: Route) -> RequestPlan:
        return plan_request(rid, prompt, gen_len, keys, n_hit_blocks, route, self.geom, self.connector,
                            self.host_of(route.pe), self.host_of(route.de))

    def _run(self, rec: RequestRecord, rid: str, prompt: Sequence[int], plan: RequestPlan, keys: Sequence[Hashable],
             held: dict[str, tuple[Any, Any]], context_keys: Callable[[RequestRecord], Sequence[Hashable]]) -> Steps:
        """From the plan to the write-back; `held` names the areas allocated meanwhile."""
        for area in plan.areas:
            held[area.name] = (area, (yield Allocate(area)))
        if plan.loads:
            rec.t_read_start = self.now()
            n_ok = yield LoadHits(rec, plan, dict(held))
            rec.t_read_end = self.now()
            if n_ok < plan.n_hit_blocks:  # the rest of the hits is recomputed: a plan with fewer
                route = replace(plan.route, pe_blocks=min(plan.route.pe_blocks, n_ok))
                plan = self._plan(rid, prompt, plan.gen_len, keys, n_ok, route)
                self._hits(rec, n_ok)
        rec.path = plan.route.path if plan.moves_kv else "none"
        rec.pe_node, rec.de_node = plan.pe_node, plan.de_node
        rec.pe_hit_bytes = plan.pe_blocks * self.geom.block_size * self.geom.kv_bytes_per_token
        rec.t_prefill_start = self.now()
        job = yield Prefill(rid, rec, plan, dict(held))
        rec.t_first_token = job.t_first_token
        if plan.moves_kv:
            yield AwaitLayers(plan, job)
        if "pe" in held:  # the PE area goes once the layers have landed
            yield Release(*held.pop("pe"))
        if plan.moves_kv and plan.writeback is not None:
            held["wb"] = (plan.writeback, (yield Allocate(plan.writeback)))
        src = held["de"][1] if "de" in held else None
        wb = held["wb"][1] if "wb" in held else None
        decoded = yield Decode(rid, rec, plan, job, src, wb)
        self._decoded(rec, decoded)
        if "de" in held:
            yield Release(*held.pop("de"))
        yield from self._write_back(rec, plan, decoded, held, context_keys(rec))
        rec.t_done = self.now()

    @staticmethod
    def _decoded(rec: RequestRecord, d: DecodeOutcome) -> None:
        rec.reread_bytes = d.reread_bytes
        rec.tokens, rec.de_layer_hashes = d.tokens, d.layer_hashes
        rec.connectors = (rec.connectors[0], d.connector)
        rec.token_times = d.token_times

    def _write_back(self, rec: RequestRecord, plan: RequestPlan, decoded: DecodeOutcome,
                    held: dict[str, tuple[Any, Any]], all_keys: Sequence[Hashable]) -> Steps:
        """Persist the Full Blocks decode wrote, then count them as hits; a plan that moves no
        KV counts the whole context as if written back, with no I/O."""
        kept: list[Hashable] = []
        if plan.moves_kv and decoded.written_blocks:
            written = [all_keys[b] if b < len(all_keys) else None for b in decoded.written_blocks]
            took = yield WriteBack(rec, plan, tuple(written), decoded, held["wb"][1])
            rec.writeback_bytes = len(written) * self.geom.full_block_bytes
            kept = [k for k, ok in zip(written, took) if ok and k is not None]
        if "wb" in held:
            yield Release(*held.pop("wb"))
        if plan.moves_kv:
            self.index.add(kept, persisted=True)
        else:
            self.index.add(all_keys, persisted=False)
