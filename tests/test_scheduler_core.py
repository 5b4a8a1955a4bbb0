"""The event-driven core: flow through the stages, load accounting, clock injection, SimPy."""
from __future__ import annotations

import pytest
import simpy
from hypothesis import given, settings, strategies as st

from dualpath.scheduler import EngineReport, Profile, ReadPath, Request, Role, Scheduler, Thresholds

PROFILE = Profile(snic_bytes_per_s=1e6, prefill_tokens_per_s=1e3, kv_bytes_per_token=100, block_tokens=16)
BLOCK = 16 * 100


def rep(eid, node, role, group, tok=0, seq=0, free=10**6, read_q=0):
    return EngineReport(eid, node, role, group, seq, tok, free, free * 100, read_q)


def cluster(s: Scheduler, n_pe=2, n_de=2, **kw):
    for i in range(n_pe):
        s.on_report(rep(f"p{i}", "pn", Role.PREFILL, "pg", **kw))
    for i in range(n_de):
        s.on_report(rep(f"d{i}", "dn", Role.DECODE, "dg", **kw))


def req(i, hit=160, miss=10, at=0.0):
    return Request(f"r{i}", hit + miss, hit, miss, at)


def test_thresholds_come_from_the_profile():
    th = Thresholds.from_profile(PROFILE)
    assert th.alpha_bytes == 3 * 1e6 and th.beta_tokens == 5 * 1e3
    faster = Profile(snic_bytes_per_s=4e6, prefill_tokens_per_s=2e3, kv_bytes_per_token=1)
    th2 = Thresholds.from_profile(faster, alpha_s=1.0, beta_s=2.0)
    assert th2.alpha_bytes == 4e6 and th2.beta_tokens == 4e3
    assert Scheduler(faster, alpha_s=1.0).thresholds.alpha_bytes == 4e6
    with pytest.raises(ValueError):
        Profile(snic_bytes_per_s=0, prefill_tokens_per_s=1, kv_bytes_per_token=1)


def test_request_flows_pe_then_de_then_back_to_pe_leader():
    now = [10.0]
    s = Scheduler(PROFILE, clock=lambda: now[0])
    cluster(s)
    s.on_request(req(0))
    assert s.pull("dg") == []  # no PE yet: the DE side has nothing to place
    assert s.pull("pg") == []  # PE chosen, DE not yet: nothing complete to deliver
    now[0] = 11.0
    [a] = s.pull("dg")
    assert (a.pe_assigned_at, a.de_assigned_at) == (10.0, 11.0)
    assert a.pe_group == "pg" and a.de_group == "dg"
    assert a.path is ReadPath.PE and a.pe_blocks == 10 and a.de_blocks == 0  # ties go to PE
    assert s.pull("pg") == [a]  # delivered to the PE leader on its next pull
    assert s.pull("pg") == []  # exactly once
    assert s.queue_lengths() == {"pe_waiting": 0, "de_global": 0, "de_private": 0, "undelivered_to_pe": 0}


def test_reports_do_not_erase_undelivered_work():
    s = Scheduler(PROFILE, clock=lambda: 0.0)
    cluster(s, n_pe=1)
    s.on_request(req(0, hit=0, miss=4000))
    s.pull("pg")
    assert s.engines["p0"].tok == 4000
    # the engine has not heard of r0, so it reports itself idle; the estimate keeps r0
    s.on_report(rep("p0", "pn", Role.PREFILL, "pg", tok=0))
    assert s.engines["p0"].tok == 4000
    s.pull("dg")
    s.pull("pg")  # delivered: from now on the engine's own report counts it
    s.on_report(rep("p0", "pn", Role.PREFILL, "pg", tok=4000))
    assert s.engines["p0"].tok == 4000


def test_read_queue_estimate_alternates_paths_within_one_pull():
    s = Scheduler(PROFILE, clock=lambda: 0.0)
    cluster(s)
    for i in range(4):
        s.on_request(req(i))
    s.pull("pg")
    paths = [a.path for a in s.pull("dg")]
    assert paths == [ReadPath.PE, ReadPath.DE, ReadPath.PE, ReadPath.DE]
    assert s.nodes["pn"].read_q == s.nodes["dn"].read_q == 2 * 10 * BLOCK
    # the PE side's bytes stay counted over a report until the PE leader has them
    s.on_report(rep("p0", "pn", Role.PREFILL, "pg", read_q=0))
    assert s.nodes["pn"].read_q == 2 * 10 * BLOCK
    s.pull("pg")
    s.on_report(rep("p0", "pn", Role.PREFILL, "pg", read_q=7))
    assert s.nodes["pn"].read_q == 7


@pytest.mark.parametrize("policy,expect", [
    ("rr", [ReadPath.PE, ReadPath.DE, ReadPath.PE]),
    ("pe", [ReadPath.PE] * 3),
    ("split", [ReadPath.SPLIT] * 3),
])
def test_path_policies_by_name(policy, expect):
    s = Scheduler(PROFILE, path_policy=policy, clock=lambda: 0.0)
    cluster(s)
    for i in range(3):
        s.on_request(req(i))
    s.pull("pg")
    out = s.pull("dg")
    assert [a.path for a in out] == expect
    assert all(a.pe_blocks + a.de_blocks == 10 for a in out)
    with pytest.raises(ValueError):
        Scheduler(PROFILE, path_policy="nope")


def test_overloaded_pe_group_leaves_requests_waiting():
    s = Scheduler(PROFILE, clock=lambda: 0.0)
    cluster(s, tok=5001)  # beta = 5000 tokens
    s.on_request(req(0))
    s.pull("pg")
    assert s.pe_waiting == 1
    s.on_report(rep("p1", "pn", Role.PREFILL, "pg", tok=0))
    s.pull("pg")
    assert s.pe_waiting == 0 and s._pending["r0"].pe.engine_id == "p1"


def test_de_hbm_bounds_admission_across_pulls():
    s = Scheduler(PROFILE, clock=lambda: 0.0)
    cluster(s, n_de=1, free=400)
    for i in range(3):
        s.on_request(req(i, hit=160, miss=40))  # 200 tokens each
    s.pull("pg")
    assert len(s.pull("dg")) == 2
    assert s.pull("dg") == []  # no report freed anything: still full
    s.on_report(rep("d0", "dn", Role.DECODE, "dg", free=200))
    assert [a.request_id for a in s.pull("dg")] == ["r2"]


def test_duplicate_ids_and_stale_engines():
    t = [0.0]
    s = Scheduler(PROFILE, clock=lambda: t[0], stale_after_s=1.0)
    cluster(s, n_pe=1)
    s.on_request(req(0))
    with pytest.raises(ValueError):
        s.on_request(req(0))
    t[0] = 5.0  # nobody reported since t=0
    s.pull("pg")
    assert s.pe_waiting == 1
    s.on_report(rep("p0", "pn", Role.PREFILL, "pg"))
    s.pull("pg")
    assert s.pe_waiting == 0


def test_bad_reports_leave_no_half_registered_engine():
    s = Scheduler(PROFILE, clock=lambda: 0.0)
    cluster(s, n_pe=1, n_de=0)
    with pytest.raises(ValueError):
        s.on_report(rep("x", "dn", Role.DECODE, "pg"))  # decode engine in a prefill group
    assert "x" not in s.engines and [e.engine_id for e in s.groups["pg"].engines] == ["p0"]
    s.on_report(rep("x", "dn", Role.DECODE, "dg"))
    assert s.groups["dg"].engines == [s.engines["x"]]
    # moving an idle engine to another group is allowed; with work in flight it is refused
    s.on_report(rep("x", "dn", Role.DECODE, "dg2", tok=7))
    assert s.groups["dg"].engines == [] and s.groups["dg2"].tok_sum == 7
    s.on_request(req(0))
    s.pull("pg")
    with pytest.raises(ValueError):
        s.on_report(rep("p0", "pn", Role.PREFILL, "pg2"))


def test_cancel_waiting_undoes_pe_load():
    s = Scheduler(PROFILE, clock=lambda: 0.0)
    cluster(s, n_pe=1)
    for i in range(2):
        s.on_request(req(i))
    s.pull("pg")
    assert s.engines["p0"].tok == 340
    assert sorted(r.request_id for r in s.cancel_waiting()) == ["r0", "r1"]
    assert s.engines["p0"].tok == 0 and s.engines["p0"].inflight_seq == 0
    s.on_request(req(0))  # the id is free again


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 300)), min_size=1, max_size=25),
       st.sampled_from(["shorter", "rr", "split"]))
def test_every_request_placed_exactly_once_with_hbm_respected(lens, policy):
    s = Scheduler(PROFILE, path_policy=policy, clock=lambda: 0.0)
    free = {f"d{i}": 5000 for i in range(2)}
    cluster(s, free=5000)
    for i, (hit, miss) in enumerate(lens):
        s.on_request(req(i, hit, miss))
    got = {}
    for _ in range(2 * len(lens) + 2):  # bounded
        s.pull("pg")
        for a in s.pull("dg"):
            assert a.request_id not in got
            got[a.request_id] = a
            free[a.de_engine] -= a.request.total_len
            assert free[a.de_engine] >= 0
            n_blocks = -(-a.request.hit_tokens // 16)
            assert a.pe_blocks + a.de_blocks == n_blocks
        if len(got) + s.queue_lengths()["de_private"] == len(lens) and not s.de_groups_with_work():
            break
        # decode finishes everything between pulls, so HBM frees up and PEs drain
        for e in free:
            s.on_report(rep(e, "dn", Role.DECODE, "dg", free=5000))
            free[e] = 5000
        for i in range(2):
            s.on_report(rep(f"p{i}", "pn", Role.PREFILL, "pg"))
    assert len(got) == len(lens)


def test_driven_by_a_simpy_clock():
    """The same core under a simulator: time is env.now, leaders pull periodically."""
    env = simpy.Environment()
    s = Scheduler(PROFILE, clock=lambda: env.now)
    cluster(s)
    placed = []

    def arrivals():
        for i in range(5):
            s.on_request(req(i, at=env.now))
            yield env.timeout(0.5)

    def leader(group, period):
        for _ in range(40):  # bounded
            for a in s.pull(group):
                placed.append((group, a.request_id, env.now, a.de_assigned_at))
            yield env.timeout(period)

    env.process(arrivals())
    env.process(leader("pg", 0.2))
    env.process(leader("dg", 0.3))
    env.run(until=10)
    de_side = [p for p in placed if p[0] == "dg"]
    pe_side = [p for p in placed if p[0] == "pg"]
    assert [p[1] for p in de_side] == [f"r{i}" for i in range(5)]
    assert sorted(p[1] for p in pe_side) == [f"r{i}" for i in range(5)]
    for _, _, t, de_at in de_side:
        assert t == de_at  # stamped with simulated time
        assert round(de_at * 10) % 3 == 0  # DE leader pulls at multiples of 0.3 s


def test_idle_read_queues_share_the_reads_between_sides():
    """Reports that say both queues are empty (reads keep up) tie every decision; the reads
    the scheduler already gave out break the tie, so both SNICs get work."""
    s = Scheduler(PROFILE)
    cluster(s)
    paths = []
    for i in range(6):
        s.on_request(req(i))
        s.pull("pg")
        [a] = s.pull("dg")
        paths.append(a.path)
        cluster(s)  # fresh reports: the reads finished, both queues are empty again
    assert paths == [ReadPath.PE, ReadPath.DE] * 3


def test_a_timed_out_request_says_what_the_scheduler_saw():
    from testbed.cluster.scheduling import why_waiting
    now = [5.0]
    s = Scheduler(PROFILE, clock=lambda: now[0])
    cluster(s, n_pe=1, n_de=1, tok=6000, free=10)  # the PE over beta (5,000 tokens), the DE nearly full
    s.on_request(req(0))
    now[0] = 7.5
    why = why_waiting(s, req(0))
    assert "needs 170 tokens" in why and "'pe_waiting': 1" in why and "under 5000 tokens" in why
    assert "p0 tok 6000 free 10 (2.5 s ago)" in why and "d0 tok 6000 free 10" in why


def test_a_queue_that_moves_is_not_a_stall():
    from testbed.cluster.scheduling import stalled
    # submitted at 0, the last admission (of another request) at 100: not stalled at 150
    assert not stalled(150.0, 0.0, 100.0, 120.0)
    assert stalled(220.0, 0.0, 100.0, 120.0)  # nothing admitted for 120 s
    assert not stalled(100.0, 50.0, 0.0, 120.0) and stalled(170.0, 50.0, 0.0, 120.0)  # counted from submission


def test_a_request_an_engine_will_not_run_stops_counting_there():
    """What the conductor's release does on an engine: a request given to it (assigned), then
    released because it failed elsewhere or was abandoned, leaves its load, whichever came first."""
    from dualpath.nodes.leader import EngineLoad
    load = EngineLoad(24689)
    load.assigned("r1", 2048)
    load.finished("r1")  # released
    load.finished("r2")  # released before its leader's late 'assigned'
    load.assigned("r2", 2048)
    assert load.pending() == {} and load.report()["free_hbm_tokens"] == 24689


def test_a_write_back_behind_a_long_queue_gets_the_time_the_queue_needs():
    from testbed.cluster.conductor import flush_timeout_s
    assert flush_timeout_s(120.0, 0, 1e9) == 120.0
    # 300 MB queued for a 20 Mbit/s write path: 120 s drain, twice that as margin
    assert flush_timeout_s(120.0, 300_000_000, 20e6) == pytest.approx(120.0 + 2 * 120.0)
    assert flush_timeout_s(120.0, 10**9, 0) == 120.0
