"""Compute quota: the cost model and chunked batch packing (every chunk the largest that fits)."""
from __future__ import annotations

import random

import pytest
from hypothesis import assume, given, settings, strategies as st

from dualpath.scheduler.batching import PrefillItem, PrefillQueue, largest_fitting_chunk, pack_batch
from dualpath.scheduler.cost_model import AttentionCostModel, ProfileSample, attention_pairs

coef = st.floats(0, 1e-3, allow_nan=False)
models = st.builds(AttentionCostModel, intercept=st.floats(0, 0.05), per_new=coef,
                   per_pair=st.floats(0, 1e-8), per_cached=st.floats(0, 1e-6))
items = st.lists(st.tuples(st.integers(0, 20_000), st.integers(1, 3000)), min_size=1, max_size=8)


def test_attention_pairs_counts_causal_pairs():
    # 2 new tokens after 3 cached: the first sees 4 keys, the second 5
    assert attention_pairs(3, 2) == 9
    assert attention_pairs(0, 1) == 1


def test_fit_recovers_known_coefficients():
    truth = AttentionCostModel(intercept=0.002, per_new=3e-6, per_pair=2e-10, per_cached=1e-7)
    rng = random.Random(1)
    samples = []
    for _ in range(60):
        batch = tuple((rng.randint(0, 30_000), rng.randint(1, 4000)) for _ in range(rng.randint(1, 4)))
        samples.append(ProfileSample(batch, truth.predict(batch)))
    m = AttentionCostModel.fit(samples)
    for k, v in truth.to_dict().items():
        assert m.to_dict()[k] == pytest.approx(v, rel=1e-6)
    assert AttentionCostModel.from_dict(m.to_dict()) == m


def test_fit_keeps_coefficients_non_negative_on_noisy_data():
    rng = random.Random(2)
    # time falls with new tokens in this (nonsense) profile: plain least squares would go negative
    samples = [ProfileSample(((0, n),), max(0.0, 0.5 - 1e-4 * n + rng.gauss(0, 0.01))) for n in range(1, 3000, 50)]
    m = AttentionCostModel.fit(samples)
    assert all(v >= 0 for v in m.to_dict().values())
    with pytest.raises(ValueError):
        AttentionCostModel.fit([])


@settings(max_examples=200, deadline=None)
@given(models, st.integers(0, 50_000), st.integers(0, 400), st.floats(0, 0.3), st.floats(0.01, 0.5))
def test_chunk_is_largest_that_fits_brute_force(m, cached, new, used, quota):
    k = largest_fitting_chunk(m, cached, new, used, quota)
    fits = [j for j in range(new + 1) if used + m.request_cost(cached, j) <= quota]
    assert k == (max(fits) if fits else 0)


@settings(max_examples=150, deadline=None)
@given(models, items, st.floats(0.01, 0.5))
def test_pack_batch_rules(m, reqs, quota):
    queue = [PrefillItem(f"r{i}", c, n) for i, (c, n) in enumerate(reqs)]
    b = pack_batch(queue, m, quota)
    assert b.entries, "a batch always makes progress"
    # FIFO: entries are a prefix of the queue; only the last may be a chunk
    assert [e.request_id for e in b.entries] == [q.request_id for q in queue[: len(b.entries)]]
    assert all(e.last and e.new == q.new for e, q in zip(b.entries[:-1], queue))
    assert b.predicted_s == m.predict(b.pairs())
    if b.over_quota:
        assert len(b.entries) == 1 and b.entries[0].new == 1
        assert m.predict([(queue[0].cached, 1)]) > quota
        return
    assert b.predicted_s <= quota
    last = b.entries[-1]
    head = queue[len(b.entries) - 1]
    prefix = b.pairs()[:-1]
    if not last.last:
        # the chunk is the largest number of the head's tokens that keeps the pass within quota
        assert 0 < last.new < head.new
        assert m.predict(prefix + [(head.cached, last.new + 1)]) > quota
    elif len(b.entries) < len(queue):
        # the next request did not fit even one token
        nxt = queue[len(b.entries)]
        assert m.predict(b.pairs() + [(nxt.cached, 1)]) > quota


@settings(max_examples=60, deadline=None)
@given(models, items, st.floats(0.05, 0.5))
def test_prefill_queue_computes_every_token_once(m, reqs, quota):
    assume(m.per_new > 0 or m.per_pair > 0 or m.per_cached > 0)
    q = PrefillQueue(m, quota)
    for i, (c, n) in enumerate(reqs):
        q.push(f"r{i}", c, n)
    done: dict[str, int] = {}
    finished = []
    for _ in range(sum(n for _, n in reqs) + 1):  # bounded: >= 1 token per pass
        if not len(q):
            break
        for e in q.next_batch().entries:
            assert e.cached == reqs[int(e.request_id[1:])][0] + done.get(e.request_id, 0)
            done[e.request_id] = done.get(e.request_id, 0) + e.new
            if e.last:
                finished.append(e.request_id)
    assert not len(q)
    assert finished == [f"r{i}" for i in range(len(reqs))]
    assert done == {f"r{i}": n for i, (_, n) in enumerate(reqs)}


def test_quota_chunks_a_long_request():
    tick = 2.0**-10  # about 1 ms per new token, exact in binary so the arithmetic is too
    m = AttentionCostModel(intercept=0.0, per_new=tick)
    b = pack_batch([PrefillItem("a", 0, 100), PrefillItem("b", 0, 500), PrefillItem("c", 0, 10)], m, 300 * tick)
    assert [(e.request_id, e.new, e.last) for e in b.entries] == [("a", 100, True), ("b", 200, False)]
    assert b.predicted_s == 300 * tick
