"""Read-path choice: shorter queue, round-robin, and the split that equalises finishing times."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from dualpath.scheduler.read_path import RoundRobin, ShorterQueue, Split, finish_times, shorter_queue, split_blocks
from dualpath.scheduler.records import NodeState, ReadPath

queue = st.integers(0, 10**9)
bw = st.floats(1e3, 1e10, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(queue, queue)
def test_chosen_path_is_the_shorter_queue(p, d):
    path = shorter_queue(p, d)
    chosen, other = (p, d) if path is ReadPath.PE else (d, p)
    assert chosen <= other
    if p != d:
        assert chosen < other


def test_ties_go_to_the_side_given_less_so_far_then_pe():
    assert shorter_queue(5, 5) is ReadPath.PE
    assert shorter_queue(5, 5, pe_read_total=100, de_read_total=40) is ReadPath.DE
    assert shorter_queue(5, 5, pe_read_total=40, de_read_total=100) is ReadPath.PE
    assert shorter_queue(6, 5, pe_read_total=0, de_read_total=10**9) is ReadPath.DE  # only on ties
    # an idle cluster alternates instead of loading the PE side's SNIC alone
    s, p, d = ShorterQueue(), NodeState("p"), NodeState("d")
    paths = []
    for _ in range(6):
        dec = s.decide(4, 100, p, d)
        paths.append(dec.path)
        p.read_total += dec.pe_blocks * 100
        d.read_total += dec.de_blocks * 100
    assert paths == [ReadPath.PE, ReadPath.DE] * 3


def test_policy_moves_all_blocks():
    dec = ShorterQueue().decide(7, 100, NodeState("p", read_q=10), NodeState("d", read_q=9))
    assert (dec.path, dec.pe_blocks, dec.de_blocks) == (ReadPath.DE, 0, 7)


def test_round_robin_alternates_regardless_of_load():
    rr = RoundRobin()
    p, d = NodeState("p", read_q=0), NodeState("d", read_q=10**12)
    paths = [rr.decide(3, 1, p, d).path for _ in range(4)]
    assert paths == [ReadPath.PE, ReadPath.DE, ReadPath.PE, ReadPath.DE]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 300), st.integers(1, 10**6), queue, queue, bw, bw)
def test_split_minimises_the_later_finish_against_brute_force(n, block, qp, qd, bp, bd):
    x, y = split_blocks(n, block, qp, qd, bp, bd)
    assert x + y == n and 0 <= x <= n
    got = max(finish_times(x, n, block, qp, qd, bp, bd))
    best = min(max(finish_times(k, n, block, qp, qd, bp, bd)) for k in range(n + 1))
    assert got <= best * (1 + 1e-12)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 2000), st.integers(1, 4096), bw, bw)
def test_split_with_empty_queues_is_proportional_to_drain_rates(n, block, bp, bd):
    x, _ = split_blocks(n, block, 0, 0, bp, bd)
    assert abs(x - n * bp / (bp + bd)) <= 1.0


def test_split_equalises_finishing_times():
    # PE side 1 GB/s with 2 GB queued (2 s), DE side 3 GB/s idle; all 100 blocks of 40 MB take the
    # DE side only 1.33 s, so every block goes there
    x, y = split_blocks(100, 4e7, 2e9, 0, 1e9, 3e9)
    assert (x, y) == (0, 100)
    # with a shorter PE backlog the crossing is interior and both sides end within one block time
    x, y = split_blocks(100, 4e7, 4e8, 0, 1e9, 3e9)
    tp, td = finish_times(x, 100, 4e7, 4e8, 0, 1e9, 3e9)
    assert 0 < x < 100
    assert abs(tp - td) <= 4e7 / 1e9
    with pytest.raises(ValueError):
        split_blocks(1, 1, 0, 0, 0, 1)


def test_split_policy_labels_the_path():
    s = Split(lambda node: 1e9)
    busy, idle = NodeState("p", read_q=10**12), NodeState("d", read_q=0)
    assert s.decide(10, 1000, busy, idle).path is ReadPath.DE
    both = s.decide(10, 1000, NodeState("p"), NodeState("d"))
    assert both.path is ReadPath.SPLIT and both.pe_blocks + both.de_blocks == 10
