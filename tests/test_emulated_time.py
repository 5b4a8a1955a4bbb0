"""The emulated GPU clock: passes and decode steps last what the cost model says, times the
dilation, and a pass that cannot fit its window is caught. Logic on a virtual clock, not timing."""
import numpy as np
import pytest
import torch

from dualpath.kv.buffers import ByteAllocator
from dualpath.kv.decode_connector import DecodePlan, OracleDecodeConnector
from dualpath.engines.clock import LATE_FLOOR_S, DeviceClock, PassTiming
from dualpath.engines.decode import DecodeBatcher, DecodeJob
from dualpath.engines.prefill import prefill_batch
from dualpath.kv.connector import LoadPlan, OracleConnector, PastRead
from dualpath.kv.spans import Span
from dualpath.kv.layouts import BlockGeometry
from dualpath.model import Transformer
from dualpath.model.tiny import DEMO, make_tiny_checkpoint
from dualpath.scheduler.cost_model import AttentionCostModel, DecodeCostModel
from testbed.measure.fidelity import verdict

K = 3.125  # a dilation
PREFILL = AttentionCostModel(intercept=0.03, per_new=1e-4, per_pair=2e-9, per_cached=1e-7)
DECODE = DecodeCostModel(intercept=0.03, per_request=1e-4, per_context=1e-7)


class VirtualTime:
    """now() only moves when the engine sleeps: compute takes no virtual time."""

    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += max(s, 0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Transformer:
    torch.set_num_threads(1)
    return Transformer.from_pretrained(make_tiny_checkpoint(tmp_path_factory.mktemp("ck"), seed=0, **DEMO))


@pytest.fixture(scope="module")
def geom(model) -> BlockGeometry:
    return BlockGeometry.from_config(model.config, block_size=16)


def _oracle_items(model, geom, batch):
    hbm = np.zeros(1, dtype=np.uint8)
    alloc = ByteAllocator(1 << 20, "hbm")
    items = []
    for i, (cached, new) in enumerate(batch):
        plan = LoadPlan(f"r{i}", cached, new, (PastRead(Span("", "", 0), 0, cached),) if cached else (), None)
        items.append(([4 + (j % 500) for j in range(new)], plan, OracleConnector(None, hbm, alloc, geom)))
    return items


def test_a_pass_lasts_the_cost_models_time_times_the_dilation(model, geom):
    vt = VirtualTime()
    clock = DeviceClock(K, now=vt.now, sleep=vt.sleep)
    batch = [(0, 40), (300, 17), (64, 5)]
    t0 = vt.t
    _, timing = prefill_batch(model, _oracle_items(model, geom, batch), clock, PREFILL)
    assert timing.emulated_s == pytest.approx(PREFILL.predict(batch))
    assert timing.held_s == pytest.approx(PREFILL.predict(batch) * K)
    assert vt.t - t0 == pytest.approx(PREFILL.predict(batch) * K)  # the virtual clock moved only by holds
    assert timing.late_s == 0 and not timing.overran


def test_the_host_clock_holds_nothing(model, geom):
    vt = VirtualTime()
    _, timing = prefill_batch(model, _oracle_items(model, geom, [(0, 8)]), DeviceClock(None, now=vt.now, sleep=vt.sleep))
    assert vt.t == 100.0 and timing.held_s == 0 and not timing.overran


def test_a_pass_that_cannot_fit_its_window_makes_the_run_unfaithful(model, geom):
    # a dilation so small that the window is nanoseconds: the real compute must run past it
    clock = DeviceClock(1e-9)
    _, timing = prefill_batch(model, _oracle_items(model, geom, [(0, 64)]), clock, PREFILL)
    assert timing.late_s > LATE_FLOOR_S and timing.overran
    ok, reasons = verdict([{**timing.to_dict(), "overran": timing.overran}], [], 0.3, [])
    assert not ok
    assert "1 of 1 prefill passes overran their emulated time" in reasons[0]


def test_lateness_margin():
    t = PassTiming(held_s=0.1, late_s=0.009)
    assert not t.overran  # 9 ms on 100 ms: within 10 %
    t.late_s = 0.011
    assert t.overran
    assert not PassTiming(held_s=0.005, late_s=0.0019).overran  # under the 2 ms floor
    assert PassTiming(held_s=0.005, late_s=0.0021).overran


def test_a_late_window_is_caught_up_by_the_next_and_only_the_end_is_judged():
    vt = VirtualTime()
    clock = DeviceClock(2.0, now=vt.now, sleep=vt.sleep)
    t = PassTiming()
    start = vt.t
    vt.t += 0.3  # layer 0's compute took 0.3 s; its window is 0.1 * 2 = 0.2 s
    end = clock.hold(start, 0.1, t)
    assert end == pytest.approx(start + 0.2)  # the schedule, not now
    vt.t += 0.05  # layer 1 computes quickly...
    end = clock.hold(end, 0.1, t)  # ...and its window (ending at +0.4) absorbs the lag
    assert vt.t == pytest.approx(start + 0.4)
    clock.finish(end, t)
    assert t.late_s == 0 and t.held_s == pytest.approx(0.4)
    vt.t += 0.5  # a last layer that runs 0.5 s past its 0.2 s window
    end = clock.hold(end, 0.1, t)
    clock.finish(end, t)
    assert t.late_s == pytest.approx(0.5 - 0.2) and t.overran  # ran past its window by 0.3 s


def test_decode_batches_every_ready_request_and_each_step_lasts_its_cost(model, geom):
    vt = VirtualTime()
    clock = DeviceClock(K, now=vt.now, sleep=vt.sleep)
    b = DecodeBatcher(model, geom, clock, DECODE)
    hbm = np.zeros(1, dtype=np.uint8)
    alloc = ByteAllocator(1 << 20, "hbm")
    specs = [("a", 20, 5), ("b", 33, 3), ("c", 7, 1)]  # request, prompt tokens, tokens to generate
    jobs = []
    for name, n, g in specs:
        plan = DecodePlan(name, n, g, n // 16, None, None)
        jobs.append(DecodeJob(plan, first_token=7, t_first_token=vt.t, conn=OracleDecodeConnector(None, hbm, alloc, geom)))
        b.admit(jobs[-1])
    done = []
    for _ in range(100):
        done += b.poll()
        if b.idle:
            break
        if b.wants_step():
            b.begin_step()
        else:
            vt.sleep(b.step_due_in() or 0.0)
    assert sorted(j.plan.request for j in done) == ["a", "b", "c"]
    # the oracle's past is zeros: each request's tokens are greedy decoding after zeros
    for j, (_, n, g) in zip(jobs, specs):
        z = torch.zeros((n, geom.n_kv_heads, geom.head_dim), dtype=geom.dtype)
        kv = [(z, z.clone()) for _ in range(geom.n_layer)]
        toks = [7]
        for _ in range(g - 1):
            r = model.prefill([toks[-1]], past_kv=kv, last_only=True)
            kv = [(torch.cat([k, nk]), torch.cat([v, nv])) for (k, v), (nk, nv) in zip(kv, r.new_kv)]
            toks.append(int(torch.argmax(r.logits[-1])))
        assert j.tokens == toks
    # step 1 batched a and b (c had nothing left to decode); step 2 too; steps 3-4 only a
    assert [s["n"] for s in b.step_log] == [2, 2, 1, 1]
    first = b.step_log[0]
    assert first["held_s"] == pytest.approx(DECODE.step_cost([21, 34]) * K, rel=1e-5)  # rounded to the us
    a = jobs[0]
    gaps = np.diff(a.token_times)
    expect = [DECODE.step_cost([21, 34]), DECODE.step_cost([22, 35]), DECODE.step_cost([23]), DECODE.step_cost([24])]
    assert gaps == pytest.approx(np.array(expect) * K)


def test_node_processes_freeze_their_startup_heap_so_a_full_collection_cannot_stall_a_pass():
    import gc

    from dualpath.nodes.common import freeze_startup_heap

    live = len(gc.get_objects())
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= live * 0.9  # start-up's objects are out of the collector's walk
        assert len(gc.get_objects()) < live * 0.1
    finally:
        gc.unfreeze()
