"""PE assignment (paper Algorithm 1): C1 skipped, C2 before C3, least tok_e, FIFO."""
from __future__ import annotations

import copy

from hypothesis import given, settings, strategies as st

from dualpath.scheduler.pe_assign import assign_pe, category
from dualpath.scheduler.records import EngineState, NodeState, Request, Role
from dualpath.scheduler.thresholds import Thresholds

TH = Thresholds(alpha_bytes=100.0, beta_tokens=1000.0)


def pe(i: int, node: NodeState, tok: int) -> EngineState:
    return EngineState(f"e{i}", node, "g", Role.PREFILL, index=i, tok=tok)


def req(i: int, n: int) -> Request:
    return Request(f"r{i}", n, n - 1, 1, 0.0) if n > 1 else Request(f"r{i}", 1, 0, 1, 0.0)


@st.composite
def scenario(draw):
    n_nodes = draw(st.integers(1, 4))
    nodes = [NodeState(f"n{k}", read_q=draw(st.integers(0, 200))) for k in range(n_nodes)]
    n_eng = draw(st.integers(1, 8))
    engines = [pe(i, nodes[draw(st.integers(0, n_nodes - 1))], draw(st.integers(0, 1500))) for i in range(n_eng)]
    lens = draw(st.lists(st.integers(1, 800), max_size=20))
    return engines, [req(i, n) for i, n in enumerate(lens)]


def reference(engines, queue, th):
    """Algorithm 1 by brute force: recompute the categories before every request."""
    out = []
    for r in queue:
        c2 = [e for e in engines if e.tok <= th.beta_tokens and e.node.read_q <= th.alpha_bytes]
        c3 = [e for e in engines if e.tok <= th.beta_tokens and e.node.read_q > th.alpha_bytes]
        pool = c2 or c3
        if not pool:
            break
        e = min(pool, key=lambda x: (x.tok, x.index))
        e.tok += r.total_len
        e.seq += 1
        out.append((r.request_id, e.engine_id))
    return out


@settings(max_examples=150, deadline=None)
@given(scenario())
def test_matches_brute_force_algorithm_1(sc):
    engines, queue = sc
    ref_engines = copy.deepcopy(engines)
    got = [(r.request_id, e.engine_id) for r, e in assign_pe(queue, engines, TH)]
    assert got == reference(ref_engines, queue, TH)
    assert [e.tok for e in engines] == [e.tok for e in ref_engines]


@settings(max_examples=150, deadline=None)
@given(scenario())
def test_rules_hold_at_every_step(sc):
    engines, queue = sc
    start = {e.engine_id: e.tok for e in engines}
    pairs = assign_pe(queue, copy.copy(engines), TH)
    # replay on a fresh load picture to see the state each decision was taken in
    tok = dict(start)
    by_id = {e.engine_id: e for e in engines}
    for r, e in pairs:
        # overloaded (C1) engines never get work
        assert tok[e.engine_id] <= TH.beta_tokens
        not_overloaded = [x for x in engines if tok[x.engine_id] <= TH.beta_tokens]
        c2 = [x for x in not_overloaded if x.node.read_q <= TH.alpha_bytes]
        if e.node.read_q > TH.alpha_bytes:
            assert not c2, "a C3 engine was chosen while C2 was non-empty"
            pool = not_overloaded
        else:
            pool = c2
        assert tok[e.engine_id] == min(tok[x.engine_id] for x in pool)
        tok[e.engine_id] += r.total_len
    assert tok == {i: by_id[i].tok for i in tok}
    # FIFO: a prefix of the queue, and it stops only when every PE is overloaded
    assert [r.request_id for r, _ in pairs] == [r.request_id for r in queue[: len(pairs)]]
    if len(pairs) < len(queue):
        assert all(t > TH.beta_tokens for t in tok.values())


def test_c2_beats_c3_even_with_more_tokens():
    short, long_ = NodeState("a", read_q=100), NodeState("b", read_q=101)
    engines = [pe(0, long_, tok=0), pe(1, short, tok=900)]
    [(r, e)] = assign_pe([req(0, 10)], engines, TH)
    assert e.engine_id == "e1"
    assert category(engines[0], TH) == 3 and category(engines[1], TH) == 2


def test_overloaded_engine_with_idle_snic_is_skipped():
    idle = NodeState("a", read_q=0)
    busy = NodeState("b", read_q=10_000)
    engines = [pe(0, idle, tok=1001), pe(1, busy, tok=1000)]
    pairs = assign_pe([req(0, 5), req(1, 5)], engines, TH)
    # e0 is C1; e1 (exactly beta: not overloaded) takes one and then is overloaded too
    assert [(r.request_id, e.engine_id) for r, e in pairs] == [("r0", "e1")]
    assert engines[0].tok == 1001


def test_head_blocks_the_queue():
    engines = [pe(0, NodeState("a"), tok=2000)]
    assert assign_pe([req(0, 1), req(1, 1)], engines, TH) == []


def test_tok_update_spreads_one_call_over_engines():
    node = NodeState("a")
    engines = [pe(i, node, tok=0) for i in range(3)]
    pairs = assign_pe([req(i, 100) for i in range(6)], engines, TH)
    assert [e.engine_id for _, e in pairs] == ["e0", "e1", "e2", "e0", "e1", "e2"]
    assert [e.tok for e in engines] == [200, 200, 200]
    assert [e.seq for e in engines] == [2, 2, 2]
