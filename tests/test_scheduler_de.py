"""DE assignment: phase 1 by least group tok, phase 2 by free HBM and the Z threshold."""
from __future__ import annotations

import copy
from collections import deque

import pytest
from hypothesis import given, settings, strategies as st

from dualpath.scheduler.de_assign import (
    GroupBalancer, assign_de_in_group, compute_z, distribute_to_groups, fitting_prefix, pick_de,
)
from dualpath.scheduler.records import EngineState, NodeState, Request, Role


def de(i: int, tok: int, seq: int, free: int) -> EngineState:
    return EngineState(f"d{i}", NodeState(f"n{i}"), "g", Role.DECODE, index=i, tok=tok, seq=seq, free_hbm=free)


def req(i: int, n: int) -> Request:
    return Request(f"r{i}", n, 0, n, 0.0)


@st.composite
def group(draw):
    n = draw(st.integers(1, 6))
    engines = [de(i, draw(st.integers(0, 3000)), draw(st.integers(0, 6)), draw(st.integers(0, 3000))) for i in range(n)]
    lens = draw(st.lists(st.integers(1, 1500), max_size=15))
    return engines, [req(i, x) for i, x in enumerate(lens)]


def reference(engines, queue):
    """Phase 2 written straight from the paper's text."""
    total_free = sum(e.free_hbm for e in engines)
    R, s = [], 0
    for r in queue:
        if s + r.total_len > total_free:
            break
        s += r.total_len
        R.append(r)
    z = 1.05 * (sum(r.total_len for r in R) + sum(e.tok for e in engines)) / len(engines)
    out = []
    for r in R:
        fits = [e for e in engines if e.free_hbm >= r.total_len]
        if not fits:
            break
        norm = [e for e in fits if e.tok + r.total_len <= z]
        high = [e for e in fits if e.tok + r.total_len > z]
        e = min(norm, key=lambda x: (x.seq, x.tok, x.index)) if norm else min(high, key=lambda x: (x.tok, x.index))
        e.tok += r.total_len
        e.seq += 1
        e.free_hbm -= r.total_len
        out.append((r.request_id, e.engine_id))
    return out, z


@settings(max_examples=150, deadline=None)
@given(group())
def test_phase2_matches_paper_text(g):
    engines, queue = g
    ref_engines = copy.deepcopy(engines)
    pairs, z = assign_de_in_group(deque(queue), engines)
    ref, ref_z = reference(ref_engines, queue)
    assert [(r.request_id, e.engine_id) for r, e in pairs] == ref
    assert z == pytest.approx(ref_z)


@settings(max_examples=150, deadline=None)
@given(group())
def test_hbm_never_overcommitted_and_z_preference(g):
    engines, queue = g
    before = {e.engine_id: (e.tok, e.seq, e.free_hbm) for e in engines}
    pairs, z = assign_de_in_group(queue, engines)
    tok = {k: v[0] for k, v in before.items()}
    seq = {k: v[1] for k, v in before.items()}
    free = {k: v[2] for k, v in before.items()}
    for r, e in pairs:
        n = r.total_len
        assert free[e.engine_id] >= n  # enough HBM at the moment of choice
        fits = [x.engine_id for x in engines if free[x.engine_id] >= n]
        norm = [k for k in fits if tok[k] + n <= z]
        if norm:  # engines staying <= Z win, least seq_e among them
            assert e.engine_id in norm
            assert seq[e.engine_id] == min(seq[k] for k in norm)
        else:  # otherwise least tok_e
            assert tok[e.engine_id] == min(tok[k] for k in fits)
        tok[e.engine_id] += n
        seq[e.engine_id] += 1
        free[e.engine_id] -= n
    assert all(e.free_hbm >= 0 for e in engines)
    assert {e.engine_id: e.free_hbm for e in engines} == free
    # FIFO within the group, and it stops only when the head fits nowhere
    assert [r.request_id for r, _ in pairs] == [r.request_id for r in queue[: len(pairs)]]
    if len(pairs) < len(queue):
        head = queue[len(pairs)]
        assert all(e.free_hbm < head.total_len for e in engines)


def test_z_formula():
    engines = [de(0, 100, 0, 0), de(1, 300, 0, 0)]
    assert compute_z(600, engines) == pytest.approx(1.05 * (600 + 400) / 2)
    with pytest.raises(ValueError):
        compute_z(1, [])


def test_fitting_prefix_counts_until_total_free_hbm():
    q = [req(0, 40), req(1, 50), req(2, 20), req(3, 1)]
    assert fitting_prefix(q, 100) == (2, 90)  # 40 + 50 + 20 > 100 stops at the third
    assert fitting_prefix(q, 39) == (0, 0)


def test_norm_prefers_least_seq_over_least_tok():
    # d2 has the fewest requests but no HBM; it still counts in Z = 1.05 * (10 + 60) / 3 = 24.5.
    # d0 (10 + 10) and d1 (0 + 10) both stay under Z: d0 wins on seq_e despite more tokens.
    engines = [de(0, tok=10, seq=1, free=1000), de(1, tok=0, seq=5, free=1000), de(2, tok=50, seq=0, free=0)]
    z = compute_z(10, engines)
    assert z == pytest.approx(24.5)
    assert pick_de(10, engines, z).engine_id == "d0"
    # a request that would push d0 over Z (10 + 15 > 24.5) but not d1 goes to d1
    assert pick_de(15, engines, z).engine_id == "d1"


def test_high_picks_least_tok_and_hbm_bounds_choice():
    engines = [de(0, tok=500, seq=0, free=5), de(1, tok=900, seq=9, free=1000), de(2, tok=800, seq=9, free=1000)]
    # z small: nobody stays under it, so least tok among those with HBM: d0 lacks HBM -> d2
    assert pick_de(10, engines, z=1.0).engine_id == "d2"
    assert pick_de(2000, engines, z=1e9) is None


def test_phase1_goes_to_least_loaded_group_and_accounts_queued():
    b = GroupBalancer()
    b.set("a", 100)
    b.set("b", 0)
    b.set("c", 50)
    queues = {k: deque() for k in "abc"}
    gq = deque([req(0, 60), req(1, 60), req(2, 10)])
    out = distribute_to_groups(gq, b, queues)
    # r0 -> b (0 -> 60); r1 -> c (50 -> 110); r2 -> b (60 -> 70)
    assert [(r.request_id, g) for r, g in out] == [("r0", "b"), ("r1", "c"), ("r2", "b")]
    assert not gq
    assert b.totals == {"a": 100, "b": 70, "c": 110}


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 1000), min_size=1),
    st.lists(st.integers(1, 500), max_size=20),
    st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 1000)), max_size=10),
)
def test_phase1_property(totals, lens, updates):
    b = GroupBalancer()
    for g, t in totals.items():
        b.set(g, t)
    for g, t in updates:  # reports changing totals between drains
        if g in totals:
            b.set(g, t)
    ref = dict(b.totals)
    queues = {g: deque() for g in totals}
    out = distribute_to_groups(deque(req(i, n) for i, n in enumerate(lens)), b, queues)
    for r, g in out:
        assert ref[g] == min(ref.values())
        assert g == min(k for k, v in ref.items() if v == ref[g])  # ties: smallest id
        ref[g] += r.total_len
    assert b.totals == ref
