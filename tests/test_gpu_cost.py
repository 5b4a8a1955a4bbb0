"""The emulated GPU: coefficient classes, target model counts, target coefficients, Table 1."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from dualpath.scheduler.batching import PrefillItem, largest_fitting_chunk, pack_batch
from dualpath.scheduler.cost_model import (AttentionCostModel, DecodeCostModel, ProfileSample, attention_pairs,
                                           capped_pairs)

# ---------------------------------------------------------------------------------------------
# dualpath.scheduler.cost_model: the capped term and the decode model
# ---------------------------------------------------------------------------------------------


def brute_capped(cached: int, new: int, cap: int) -> int:
    return sum(min(cached + i, cap) for i in range(1, new + 1))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 5000), st.integers(-3, 600), st.integers(0, 6000))
def test_capped_pairs_matches_brute_force(cached, new, cap):
    assert capped_pairs(cached, new, cap) == brute_capped(cached, new, cap)


def test_capped_pairs_edges():
    assert capped_pairs(0, 5, 3) == 1 + 2 + 3 + 3 + 3
    assert capped_pairs(10, 4, 3) == 12  # every query already past the cap
    assert capped_pairs(100, 50, 10**9) == attention_pairs(100, 50)  # a cap never reached is no cap
    assert capped_pairs(7, 9, 0) == 0  # cap 0: no capped attention
    with pytest.raises(ValueError):
        capped_pairs(1, 1, -1)


def test_request_cost_adds_the_capped_term():
    m = AttentionCostModel(intercept=1.0, per_new=2.0, per_pair=3.0, per_cached=5.0, per_capped_pair=7.0, pair_cap=4)
    # cached 2, new 3: pairs 3+4+5 = 12; capped min(3,4)+min(4,4)+min(5,4) = 11
    assert m.request_cost(2, 3) == 2 * 3 + 3 * 12 + 7 * 11 + 5 * 2
    assert m.request_cost(2, 0) == 0.0
    assert m.predict([(2, 3), (0, 1)]) == 1.0 + 129 + (2 + 3 + 7)


capped_models = st.builds(AttentionCostModel, intercept=st.floats(0, 0.05), per_new=st.floats(0, 1e-3),
                          per_pair=st.floats(0, 1e-8), per_cached=st.floats(0, 1e-6),
                          per_capped_pair=st.floats(1e-12, 1e-7), pair_cap=st.integers(1, 4096))


@settings(max_examples=300, deadline=None)
@given(capped_models, st.integers(0, 100_000), st.integers(0, 5000))
def test_request_cost_is_monotone_in_new(m, cached, new):
    assert m.request_cost(cached, new + 1) >= m.request_cost(cached, new)


@settings(max_examples=150, deadline=None)
@given(capped_models, st.integers(0, 20_000), st.integers(0, 300), st.floats(0, 0.3), st.floats(0.01, 0.5))
def test_chunk_search_holds_with_a_capped_model(m, cached, new, used, quota):
    k = largest_fitting_chunk(m, cached, new, used, quota)
    fits = [j for j in range(new + 1) if used + m.request_cost(cached, j) <= quota]
    assert k == (max(fits) if fits else 0)


def test_attention_cost_model_dicts_old_and_new():
    old = {"intercept": 0.1, "per_new": 1e-4, "per_pair": 1e-9, "per_cached": 1e-7}  # before the capped term
    m = AttentionCostModel.from_dict(old)
    assert (m.per_capped_pair, m.pair_cap) == (0.0, 0)
    c = AttentionCostModel(per_new=1.0, per_capped_pair=2.0, pair_cap=2048)
    assert AttentionCostModel.from_dict(c.to_dict()) == c
    assert AttentionCostModel.from_dict({**c.to_dict(), "pair_cap": 2048.0}).pair_cap == 2048  # JSON float
    with pytest.raises(ValueError):
        AttentionCostModel.from_dict({**c.to_dict(), "pair_cap": 2048.5})


@pytest.mark.parametrize("kw", [
    {"per_capped_pair": -1.0, "pair_cap": 4},
    {"per_capped_pair": float("inf"), "pair_cap": 4},
    {"per_capped_pair": 1.0, "pair_cap": 0},  # a capped coefficient that could never apply
    {"pair_cap": -1},
    {"pair_cap": 2.0},
    {"pair_cap": True},
    {"per_new": float("nan")},
])
def test_attention_cost_model_validation(kw):
    with pytest.raises(ValueError):
        AttentionCostModel(**kw)


def test_fit_leaves_the_capped_term_at_zero():
    truth = AttentionCostModel(intercept=0.01, per_new=1e-5, per_pair=1e-9)
    samples = [ProfileSample(((c, n),), truth.predict([(c, n)])) for c in (0, 1000, 5000) for n in (1, 100, 700)]
    m = AttentionCostModel.fit(samples)
    assert (m.per_capped_pair, m.pair_cap) == (0.0, 0)
    assert len(AttentionCostModel.features([(1, 1)])) == 4


def test_decode_step_cost_arithmetic():
    d = DecodeCostModel(intercept=10.0, per_request=1.0, per_context=0.5, per_capped_context=2.0, context_cap=100)
    # contexts 40 and 300: 10 + (1 + 20 + 80) + (1 + 150 + 200)
    assert d.step_cost([40, 300]) == 10 + 101 + 351
    assert d.step_cost([]) == 0.0  # no sequences, no step
    dense = DecodeCostModel(intercept=1.0, per_request=2.0, per_context=3.0)
    assert dense.step_cost((5,)) == 1 + 2 + 15
    with pytest.raises(ValueError):
        d.step_cost([-1])


def test_decode_cost_model_dicts_and_validation():
    d = DecodeCostModel(intercept=1.0, per_request=2.0, per_context=3.0, per_capped_context=4.0, context_cap=2048)
    assert DecodeCostModel.from_dict(d.to_dict()) == d
    assert DecodeCostModel.from_dict({"intercept": 1.0, "per_request": 0.0, "per_context": 0.0}).context_cap == 0
    for kw in ({"intercept": -1.0}, {"per_capped_context": 1.0}, {"context_cap": -5}, {"context_cap": 1.5},
               {"per_context": float("inf")}):
        with pytest.raises(ValueError):
            DecodeCostModel(**kw)
