"""The scheduler under faults (issue 14): a node whose SNIC is down reads by the other path, and
engines that stop reporting get no work, their group's queue going to the live groups."""
from __future__ import annotations

import pytest

from dualpath.scheduler import EngineReport, Profile, ReadPath, Request, Role, Scheduler
from dualpath.scheduler.messages import EngineReportMsg, parse, pack
from dualpath.scheduler.read_path import avoid_down
from dualpath.scheduler.records import NodeState, PathDecision

PROFILE = Profile(snic_bytes_per_s=1e6, prefill_tokens_per_s=1e3, kv_bytes_per_token=100, block_tokens=16)


def rep(eid, node, role, group, snic_up=True, read_q=0, free=10**6):
    return EngineReport(eid, node, role, group, 0, 0, free, free * 100, read_q, snic_up)


def req(i, hit=160, miss=10):
    return Request(f"r{i}", hit + miss, hit, miss, 0.0)


def test_a_decision_on_a_down_snic_moves_wholly_to_the_other_side():
    up, down = NodeState("a"), NodeState("b", snic_up=False)
    assert avoid_down(PathDecision(ReadPath.PE, 10, 0), down, up) == (PathDecision(ReadPath.DE, 0, 10), "b")
    assert avoid_down(PathDecision(ReadPath.DE, 0, 10), up, down) == (PathDecision(ReadPath.PE, 10, 0), "b")
    assert avoid_down(PathDecision(ReadPath.SPLIT, 4, 6), down, up) == (PathDecision(ReadPath.DE, 0, 10), "b")
    assert avoid_down(PathDecision(ReadPath.SPLIT, 4, 6), up, down) == (PathDecision(ReadPath.PE, 10, 0), "b")
    # already on the working side, nothing to read, or no side to move to: unchanged
    assert avoid_down(PathDecision(ReadPath.DE, 0, 10), down, up) == (PathDecision(ReadPath.DE, 0, 10), "")
    assert avoid_down(PathDecision(ReadPath.PE, 0, 0), down, up) == (PathDecision(ReadPath.PE, 0, 0), "")
    both = NodeState("c", snic_up=False)
    assert avoid_down(PathDecision(ReadPath.PE, 10, 0), down, both) == (PathDecision(ReadPath.PE, 10, 0), "")


def _cluster(s: Scheduler, pe_up=True, de_up=True, n_de_groups=1):
    for i in range(2):
        s.on_report(rep(f"p{i}", "pn", Role.PREFILL, "pg", snic_up=pe_up))
    for g in range(n_de_groups):
        for i in range(2):
            s.on_report(rep(f"d{g}.{i}", f"dn{g}", Role.DECODE, f"dg{g}", snic_up=de_up))


@pytest.mark.parametrize("policy", ["shorter", "rr", "split"])
def test_with_the_pe_snic_down_every_read_goes_by_the_de_path(policy):
    s = Scheduler(PROFILE, path_policy=policy, clock=lambda: 0.0)
    _cluster(s, pe_up=False)
    for i in range(6):
        s.on_request(req(i))
    s.pull("pg")
    out = s.pull("dg0")
    assert len(out) == 6
    assert all(a.path is ReadPath.DE and a.pe_blocks == 0 and a.de_blocks == 10 for a in out)
    assert sum(a.avoided == "pn" for a in out) >= 3  # shorter would have sent some to the PE side
    assert s.nodes["pn"].read_q == 0


def test_with_the_de_snic_down_reads_go_by_the_pe_path():
    s = Scheduler(PROFILE, path_policy="rr", clock=lambda: 0.0)
    _cluster(s, de_up=False)
    for i in range(4):
        s.on_request(req(i))
    s.pull("pg")
    out = s.pull("dg0")
    assert [a.path for a in out] == [ReadPath.PE] * 4
    assert [a.avoided for a in out] == ["", "dn0", "", "dn0"]


def test_the_single_path_baseline_keeps_its_path_and_recomputes():
    s = Scheduler(PROFILE, path_policy="pe", clock=lambda: 0.0)
    _cluster(s, pe_up=False)
    s.on_request(req(0))
    s.pull("pg")
    [a] = s.pull("dg0")
    assert a.path is ReadPath.PE and a.avoided == ""  # no second path: the conductor recomputes


def test_the_snic_state_follows_the_latest_report():
    s = Scheduler(PROFILE, path_policy="shorter", clock=lambda: 0.0)
    _cluster(s, pe_up=False)
    assert not s.nodes["pn"].snic_up
    s.on_report(rep("p0", "pn", Role.PREFILL, "pg", snic_up=True))
    assert s.nodes["pn"].snic_up


def test_the_report_message_carries_the_snic_state_and_defaults_to_up():
    base = dict(engine_id="e", node_id="n", role="prefill", group_id="g", seq_e=0, tok_e=0,
                free_hbm_tokens=1, free_hbm_bytes=1, read_q_bytes=0)
    assert EngineReportMsg(**base).to_record().snic_up is True
    assert EngineReportMsg(**base, snic_up=False).to_record().snic_up is False
    with pytest.raises(Exception):
        EngineReportMsg(**base, snic_up="no")  # strict: a bool, nothing else
    msg = parse(pack({"type": "pull", "msg_id": 1, "group_id": "g", "reports": [{**base, "snic_up": False}]}))
    assert msg.reports[0].snic_up is False


def test_engines_that_stop_reporting_get_no_work_and_a_dead_groups_queue_moves():
    now = [0.0]
    s = Scheduler(PROFILE, clock=lambda: now[0], stale_after_s=1.0)
    _cluster(s, n_de_groups=2)
    for i in range(4):
        s.on_request(req(i))
    s.pull("pg")
    s.pull("dg1")  # phase 1 spreads the four over both groups; dg1 takes its own at once
    assert s.queue_lengths()["de_private"] == 2  # dg0's two wait for dg0's pull
    now[0] = 5.0  # dg0's engines fall silent (their leader died); the others keep reporting
    for i in range(2):
        s.on_report(rep(f"p{i}", "pn", Role.PREFILL, "pg"))
        s.on_report(rep(f"d1.{i}", "dn1", Role.DECODE, "dg1"))
    out = s.pull("dg1")
    assert sorted(a.request_id for a in out) == ["r0", "r2"]
    assert all(a.de_group == "dg1" for a in out)
    assert s.queue_lengths()["de_private"] == 0
    # new work goes to the live group only
    s.on_request(req(9))
    s.pull("pg")
    [a] = s.pull("dg1")
    assert a.request_id == "r9"
    assert s.pull("dg0") == []
    # dg0 comes back: it is given work again
    for i in range(2):
        s.on_report(rep(f"d0.{i}", "dn0", Role.DECODE, "dg0"))
    for i in range(10, 14):
        s.on_request(req(i))
    s.pull("pg")
    assert s.pull("dg0")


def test_a_stale_prefill_engine_gets_no_new_request():
    now = [0.0]
    s = Scheduler(PROFILE, clock=lambda: now[0], stale_after_s=1.0)
    _cluster(s)
    now[0] = 5.0
    s.on_report(rep("p1", "pn", Role.PREFILL, "pg"))  # p0 died: only p1 still reported
    for i in range(4):
        s.on_request(req(i))
    s.pull("pg")
    s.on_report(rep("d0.0", "dn0", Role.DECODE, "dg0"))
    s.on_report(rep("d0.1", "dn0", Role.DECODE, "dg0"))
    out = s.pull("dg0")
    assert len(out) == 4 and {a.pe_engine for a in out} == {"p1"}
