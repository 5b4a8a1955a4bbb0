"""The doorbell (dualpath.scheduler.service.Doorbell) rings exactly the groups that the rule
over every group's waiting work (groups_to_ring) rings, in the same order, through every kind
of scheduler event: reports, new groups, requests, pulls, stale groups reclaimed, cancels."""
from __future__ import annotations

import random

import pytest

from dualpath.scheduler import EngineReport, Profile, Request, Role, Scheduler
from dualpath.scheduler.service import Doorbell, groups_to_ring

PROFILE = Profile(snic_bytes_per_s=1e6, prefill_tokens_per_s=1e3, kv_bytes_per_token=100, block_tokens=16)
# (engine, node, role, group), in the order they first report: roles interleave, so the order
# of the rings is the groups' registration order, not PE groups first
ENGINES = [("d0", "n2", Role.DECODE, "dg0"), ("p0", "n0", Role.PREFILL, "pa"),
           ("d1", "n3", Role.DECODE, "dg1"), ("p1", "n0", Role.PREFILL, "pa"),
           ("p2", "n1", Role.PREFILL, "pb"), ("d2", "n3", Role.DECODE, "dg1"),
           ("d3", "n4", Role.DECODE, "dg2"), ("d4", "n5", Role.DECODE, "dg3")]


def _drive(seed: int, steps: int) -> tuple[int, int]:
    rnd = random.Random(seed)
    now = [0.0]
    s = Scheduler(PROFILE, clock=lambda: now[0], stale_after_s=5.0)
    bell, seen = Doorbell(s), {}
    registered = 2  # more engines (and groups) join as the run goes on
    rings = checks = 0
    for i in range(steps):
        op = rnd.random()
        if op < 0.35:
            eid, node, role, group = ENGINES[rnd.randrange(registered)]
            s.on_report(EngineReport(eid, node, role, group, rnd.randrange(3), rnd.randrange(2000),
                                     rnd.choice([0, 300, 5000, 10 ** 6]), 0, rnd.randrange(10 ** 6)))
        elif op < 0.55:
            hit = rnd.randrange(0, 400)
            s.on_request(Request(f"r{i}", hit + 40, hit, 40, now[0]))
        elif op < 0.9:
            s.pull(rnd.choice(sorted(s.groups)) if s.groups else "none")
        elif op < 0.93:
            now[0] += rnd.choice([0.5, 6.0])  # sometimes long enough that groups go stale
        elif op < 0.95:
            s.cancel_waiting()
        elif registered < len(ENGINES):
            registered += 1
        want = groups_to_ring(s, seen)
        assert bell.groups_to_ring() == want, (seed, i)
        rings += len(want)
        checks += 1
    return checks, rings


@pytest.mark.parametrize("seed", range(8))
def test_the_doorbell_rings_what_the_full_scan_rings(seed):
    checks, rings = _drive(seed, 3000)
    assert rings > 100  # the run did ring, often: the comparison was not of empty lists


def test_a_group_whose_queue_did_not_change_is_not_rung_again():
    s = Scheduler(PROFILE)
    bell = Doorbell(s)
    s.on_report(EngineReport("p0", "n0", Role.PREFILL, "pa", 0, 0, 10 ** 6, 0, 0))
    s.on_report(EngineReport("d0", "n1", Role.DECODE, "dg", 0, 0, 10 ** 6, 0, 0))
    assert bell.groups_to_ring() == []  # nothing waits
    s.on_request(Request("r1", 100, 60, 40, 0.0))
    assert bell.groups_to_ring() == ["pa"]  # the PE queue grew
    assert bell.groups_to_ring() == []  # unchanged since
    assert s.pull("pa") == []  # the request goes to a PE; it now waits for a DE
    assert bell.groups_to_ring() == ["dg"]
    assert len(s.pull("dg")) == 1  # decided: the assignment waits in the PE group's outbox
    assert bell.groups_to_ring() == ["pa"]
    s.on_report(EngineReport("d0", "n1", Role.DECODE, "dg", 1, 100, 10 ** 6, 0, 0))
    assert bell.groups_to_ring() == []  # a report changes no queue
