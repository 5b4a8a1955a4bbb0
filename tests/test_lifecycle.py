"""The request lifecycle as pure code (dualpath.lifecycle), driven by a scripted executor: the
steps it asks for, what it records, what it leaves in the store's index, retries and cleanup.
The testbed's conductor and the simulator perform these same steps (tests/test_e2e.py,
tests/test_faults.py and tests/test_sim_cluster.py run them on a cluster)."""
import asyncio
from dataclasses import dataclass

import pytest

from dualpath.kv.plan import Route
from dualpath.lifecycle.drive import run_async
from dualpath.lifecycle.index import StoreIndex
from dualpath.lifecycle.prefill import PrefillBatcher, PrefillJob
from dualpath.lifecycle.record import RequestRecord
from dualpath.lifecycle.request import MAX_ATTEMPTS, RequestLifecycle
from dualpath.lifecycle.steps import (AfterFailure, Allocate, AskRoute, AwaitLayers, Decode, DecodeOutcome, GaveUp,
                                      LoadHits, NextInstant, PassOutcome, PassResult, Prefill, Release, RunPass,
                                      StepError, WriteBack)
from dualpath.scheduler.cost_model import AttentionCostModel


@dataclass(frozen=True)
class Geom:
    block_size: int = 4
    n_layer: int = 2
    kv_bytes_per_token: int = 10

    @property
    def full_block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    def blocks_spanned(self, n: int) -> int:
        return -(-n // self.block_size)


PROMPT = list(range(18))  # 4 Full Blocks and a 2-token tail
KEYS = [f"k{b}" for b in range(4)]


def context_keys(rec: RequestRecord) -> list[str]:
    return [f"k{b}" for b in range((rec.n_prompt + rec.gen_len - 1) // 4)]


class Script:
    """An executor that performs every step at once, logs it, and fails where it is told to."""

    def __init__(self, path: str = "de", pe_blocks: int = 0, loaded: int | None = None,
                 fail: dict | None = None, retry: bool = True):
        self.path, self.pe_blocks, self.loaded, self.retry = path, pe_blocks, loaded, retry
        self.fail = dict(fail or {})  # step type -> failures left
        self.log: list = []
        self.held: set = set()
        self.next_handle = 0

    def perform(self, step):
        self.log.append(step)
        if self.fail.get(type(step), 0) > 0:
            self.fail[type(step)] -= 1
            raise StepError(f"{type(step).__name__} failed")
        if isinstance(step, AskRoute):
            return Route("p0e0", "d0e0", self.path, self.pe_blocks)
        if isinstance(step, Allocate):
            self.next_handle += 1
            self.held.add(self.next_handle)
            return self.next_handle
        if isinstance(step, Release):
            self.held.remove(step.handle)
            return None
        if isinstance(step, LoadHits):
            return step.plan.n_hit_blocks if self.loaded is None else self.loaded
        if isinstance(step, Prefill):
            job = PrefillJob(step.rec, step.plan, step.rid, step.rec.n_hit, lambda j, e: None)
            job.t_first_token, job.first_token = 1.5, 7
            return job
        if isinstance(step, Decode):
            first = step.plan.first_new_block
            n = step.plan.writeback.blocks if step.plan.writeback and step.plan.moves_kv else 0
            return DecodeOutcome(tokens=[7] * step.plan.gen_len, written_blocks=range(first, first + n))
        if isinstance(step, WriteBack):
            return [True] * len(step.keys)
        if isinstance(step, AfterFailure):
            return self.retry
        if isinstance(step, GaveUp):
            return "f1"
        return None  # AwaitLayers

    def run(self, steps):
        value, error = None, None
        while True:
            try:
                step = steps.throw(error) if error else steps.send(value)
            except StopIteration as stop:
                return stop.value
            try:
                value, error = self.perform(step), None
            except StepError as e:
                value, error = None, e


def _lifecycle(index: StoreIndex, connector: str = "layerwise") -> RequestLifecycle:
    clock = iter(range(1000))
    return RequestLifecycle(Geom(), connector, index, lambda e: e[:2], lambda: float(next(clock)))


def _run(script: Script, index: StoreIndex, connector: str = "layerwise", gen_len: int = 7) -> RequestRecord:
    rec = RequestRecord("r", 0, 0, "m")
    script.run(_lifecycle(index, connector).request(rec, PROMPT, gen_len, KEYS, context_keys))
    return rec


def test_a_de_path_request_takes_the_steps_in_order_and_stores_what_decode_wrote():
    index, s = StoreIndex(KEYS[:3]), Script()
    rec = _run(s, index)
    assert [type(x).__name__ for x in s.log] == ["AskRoute", "Allocate", "LoadHits", "Prefill", "AwaitLayers",
                                                "Allocate", "Decode", "Release", "WriteBack", "Release"]
    assert (rec.n_hit, rec.n_miss, rec.hit_bytes, rec.path) == (12, 6, 120, "de")
    assert s.held == set()  # every area given back
    # 18 + 7 - 1 = 24 tokens of KV: Full Blocks 3..5 are new; the store now holds 0..5
    wb = next(x for x in s.log if isinstance(x, WriteBack))
    assert wb.keys == ("k3", "k4", "k5") and rec.writeback_bytes == 3 * 40
    assert index.stored == {f"k{b}" for b in range(6)} and index.persisted == {"k3", "k4", "k5"}
    assert rec.error == "" and rec.attempts == 1 and rec.t_first_token == 1.5


def test_unreadable_hits_are_recomputed_with_a_plan_of_fewer():
    s = Script(path="split", pe_blocks=2, loaded=1)
    rec = _run(s, StoreIndex(KEYS))
    prefill = next(x for x in s.log if isinstance(x, Prefill))
    assert rec.n_hit == 4 and prefill.plan.n_hit_blocks == 1 and prefill.plan.pe_blocks == 1
    assert rec.pe_hit_bytes == 40


def test_a_failure_frees_every_area_and_the_request_starts_over_as_a_new_one():
    s = Script(fail={Decode: 1})
    rec = _run(s, StoreIndex(KEYS[:3]))
    assert s.held == set() and rec.attempts == 2 and rec.error == ""
    routes = [x.request.request_id for x in s.log if isinstance(x, AskRoute)]
    assert routes == ["r", "r~1"]


def test_a_request_gives_up_after_its_attempts_and_names_the_fault():
    s = Script(fail={Prefill: MAX_ATTEMPTS})
    rec = _run(s, StoreIndex())
    assert rec.attempts == MAX_ATTEMPTS and s.held == set()
    assert rec.error == f"request r: gave up after {MAX_ATTEMPTS} attempts: Prefill failed (fault f1)"


def test_a_failure_no_process_explains_is_not_retried():
    s = Script(fail={WriteBack: 1}, retry=False)
    rec = _run(s, StoreIndex(KEYS[:3]))
    assert rec.attempts == 1 and rec.error == "request r: WriteBack failed (fault f1)" and s.held == set()


def test_a_refused_route_fails_the_request_without_planning_it():
    s = Script(fail={AskRoute: 1})
    rec = _run(s, StoreIndex())
    assert [type(x) for x in s.log] == [AskRoute, GaveUp] and rec.t_done > 0


def test_the_oracle_moves_nothing_and_counts_the_whole_context_as_stored():
    index, s = StoreIndex(), Script()
    rec = _run(s, index, connector="oracle")
    assert [type(x) for x in s.log] == [AskRoute, Prefill, Decode]
    assert rec.path == "none" and index.stored == set(context_keys(rec)) and index.persisted == set()


def _job(rid: str, n_prompt: int, done: list) -> PrefillJob:
    rec = RequestRecord(rid, 0, 0, "m")
    plan = type("P", (), {"n_prompt": n_prompt})()
    return PrefillJob(rec, plan, rid, 0, lambda j, e: done.append((j.rid, e)))


def test_prefill_passes_chunk_under_the_quota_and_count_the_chunk_re_reads():
    # a pass costs its new tokens' worth: a quota of 10 tokens splits 16 into 10 + 6
    cost = AttentionCostModel(per_new=1.0)
    b = PrefillBatcher(cost, quota_s=10.0, kv_bytes_per_token=10, now=lambda: 0.0)
    done: list = []
    a, c = _job("a", 16, done), _job("b", 2, done)
    assert b.push("pe0", a) and not b.push("pe0", c)
    steps, value, passes = b.passes_of("pe0"), None, []
    while True:
        try:
            step = steps.send(value)
        except StopIteration:
            break
        if isinstance(step, NextInstant):
            value = None
            continue
        passes.append([(e.request_id, e.new) for e in step.batch.entries])
        value = PassOutcome(2.0, [PassResult(attention_s=1.0) for _ in step.jobs], {"predicted_s": 1.0})
    assert passes == [[("a", 10)], [("a", 6), ("b", 2)]]
    assert sorted(done) == [("a", None), ("b", None)] and "pe0" not in b.running
    assert len(b.passes) == 2 and b.passes[0]["loaded"] and not b.passes[1]["loaded"]
    # a's second chunk read its first 10 tokens' KV back; b ran once
    assert (a.rec.passes, a.rec.chunk_read_bytes, a.rec.attention_s, a.t_first_token) == (2, 100, 2.0, 2.0)
    assert (c.rec.passes, c.rec.chunk_read_bytes) == (1, 0)


def test_run_async_turns_an_executors_errors_into_step_errors_the_lifecycle_sees():
    seen = []

    def steps():
        try:
            yield "boom"
        except StepError as e:
            seen.append((str(e), type(e.cause).__name__))
        return "done"

    async def perform(step):
        raise KeyError("the executors own error")

    assert asyncio.run(run_async(steps(), perform, (KeyError,))) == "done"
    assert seen == [("'the executors own error'", "KeyError")]
    with pytest.raises(KeyError):  # not one the request survives: out through the lifecycle
        asyncio.run(run_async(steps(), perform))


def test_a_request_no_engine_could_hold_fails_before_it_is_routed_naming_the_budget():
    from dualpath.scheduler.hbm import DecodeHbm, HbmLimit, HbmPlan

    lim = HbmLimit(budget_bytes=1000, past_bytes_per_token=10, new_bytes_per_token=10)
    plan = HbmPlan(lim, lim, DecodeHbm(budget_bytes=200, kv_bytes_per_token=10))  # 20 tokens per DE
    clock = iter(range(1000))
    lc = RequestLifecycle(Geom(), "layerwise", StoreIndex(), lambda e: e[:2], lambda: float(next(clock)), hbm=plan)
    rec, s = RequestRecord("r", 0, 0, "m"), Script()
    s.run(lc.request(rec, PROMPT, 7, KEYS, context_keys))  # 18 + 7 = 25 tokens of KV > 20
    assert s.log == [] and rec.error.startswith("request r: its 25 tokens of KV need") and "200" not in rec.error
    assert "0.00 GB" in rec.error and "(20 tokens" in rec.error
    rec2, s2 = RequestRecord("r2", 0, 0, "m"), Script()
    s2.run(lc.request(rec2, PROMPT[:10], 7, KEYS[:2], context_keys))  # 17 tokens: fits and runs
    assert rec2.error == "" and type(s2.log[0]).__name__ == "AskRoute"


def test_a_pass_records_its_batch_tokens_and_hbm_use():
    from dualpath.scheduler.hbm import HbmLimit

    lim = HbmLimit(budget_bytes=25, past_bytes_per_token=1, new_bytes_per_token=1)
    b = PrefillBatcher(AttentionCostModel(per_new=1e-9), 1.0, 10, lambda: 0.0, lim)
    jobs = []
    for i in range(3):
        rec = RequestRecord(f"r{i}", i, 0, "m")
        rec.n_hit = 4
        plan = type("P", (), {"n_prompt": 10})()
        jobs.append(PrefillJob(rec, plan, f"r{i}", 4, lambda j, e: None))
    assert b.push("p0", jobs[0]) and not b.push("p0", jobs[1]) and not b.push("p0", jobs[2])
    gen, sizes, reply = b.passes_of("p0"), [], None
    while True:
        try:
            step = gen.send(reply)
        except StopIteration:
            break
        reply = None
        if isinstance(step, RunPass):
            sizes.append(len(step.jobs))
            res = [PassResult(first_token=1, attention_s=0.0, read_wait_s=0.0, crcs=[]) for _ in step.jobs]
            reply = PassOutcome(results=res, record={}, t_end=0.0)
    # 10 tokens each in a 25-byte budget: r2 gets the one new token that fits, then the rest
    assert sizes == [3, 1]
    assert [(p["batch_tokens"], p["hbm_peak_bytes"], p["hbm_limited"], p["chunked"]) for p in b.passes] == [
        (25, 25, True, True), (10, 10, False, False)]
