"""The live policy: the scheduler's rules applied per arriving request from live state."""
import pytest

from dualpath.scheduler.live import LivePolicy
from dualpath.scheduler.records import ReadPath, Request
from dualpath.scheduler.thresholds import Profile

PROFILE = Profile(snic_bytes_per_s=1e6, prefill_tokens_per_s=100, kv_bytes_per_token=1000, block_tokens=16)
PE = [("p0e0", "p0"), ("p0e1", "p0")]
DE = [("d0e0", "d0"), ("d1e0", "d1")]


def req(i: int, n: int = 100) -> Request:
    return Request(f"r{i}", n, n - 10, 10, float(i))


def test_path_follows_the_shorter_read_queue():
    p = LivePolicy(PE, DE, PROFILE, hbm_tokens=10_000)
    p.read_queued("p0", 5_000)
    _, de, path = p.choose(req(0))
    assert path is ReadPath.DE  # the PE node's queue is longer
    p.read_queued("d0", 9_000)
    p.read_queued("d1", 9_000)
    assert p.choose(req(1))[2] is ReadPath.PE
    p.read_done("p0", 5_000)
    assert p.nodes["p0"].read_q == 0


def test_overloaded_prefill_engines_get_nothing_until_work_finishes():
    p = LivePolicy(PE, DE, PROFILE, hbm_tokens=10_000)  # beta = 5 s * 100 tok/s = 500 tokens
    taken = [p.choose(req(i, 300)) for i in range(5)]
    assert all(t is not None for t in taken[:4])  # 300 <= beta, then 600 > beta: C1
    assert taken[4] is None  # both PEs overloaded: the head of the queue waits
    pe = taken[0][0]
    p.prefill_done(pe, req(0, 300))
    assert p.choose(req(9, 100))[0] == pe  # only the engine that finished work is admitted


def test_decode_hbm_is_never_overcommitted():
    p = LivePolicy(PE, DE, PROFILE, hbm_tokens=250)
    got = [p.choose(req(i, 100)) for i in range(6)]
    placed = [g for g in got if g is not None]
    per_de = {}
    for _, de, _ in placed:
        per_de[de] = per_de.get(de, 0) + 100
    assert all(v <= 250 for v in per_de.values())
    assert len(placed) == 4  # two per DE fit in 250 tokens of HBM


def test_round_robin_alternates_paths_and_engines():
    p = LivePolicy(PE, DE, PROFILE, hbm_tokens=10_000, policy="rr")
    got = [p.choose(req(i)) for i in range(4)]
    assert [g[2] for g in got] == [ReadPath.PE, ReadPath.DE, ReadPath.PE, ReadPath.DE]
    assert [g[0] for g in got] == ["p0e0", "p0e1", "p0e0", "p0e1"]
    with pytest.raises(ValueError):
        LivePolicy(PE, DE, PROFILE, 1, policy="random")


def test_profile_fits_a_cost_model_on_the_engine_loop(tmp_path):
    from dualpath.model.tiny import make_tiny_checkpoint
    from testbed.profile import profile

    res = profile(make_tiny_checkpoint(tmp_path / "ckpt"), quota_s=0.05, reps=1)
    m = res["cost_model"]
    assert all(v >= 0 for v in m.values()) and m["per_new"] > 0
    from dualpath.scheduler.cost_model import AttentionCostModel

    fit = AttentionCostModel.from_dict(m)
    ex = res["example_chunk"]
    k = ex["largest_chunk_in_quota"]
    assert fit.request_cost(ex["cached"], k) <= 0.05 < fit.request_cost(ex["cached"], k + 1)
    assert res["beta_tokens_at_5s"] == pytest.approx(5 * res["prefill_tokens_per_s"])
