"""Chained prefix keys and striping (no servers needed)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.store import BadKeyError, chain_keys, check_key, is_valid_key, server_index
from dualpath.store.striping import group_by_server


def test_only_full_blocks_get_keys():
    assert len(chain_keys(list(range(10)), 4)) == 2
    assert chain_keys(list(range(3)), 4) == []
    assert all(is_valid_key(k) for k in chain_keys(list(range(64)), 8))


def test_shared_prefix_shares_keys_then_diverges():
    a = list(range(100, 132))  # 4 blocks of 8
    b = a.copy()
    b[17] += 1  # differs inside block 2
    ka, kb = chain_keys(a, 8), chain_keys(b, 8)
    assert ka[:2] == kb[:2]
    # Every key from the first differing block on differs, even though block 3's tokens are equal.
    assert all(x != y for x, y in zip(ka[2:], kb[2:]))


def test_same_tokens_at_another_position_get_another_key():
    blk = [7] * 8
    keys = chain_keys(blk * 3, 8)
    assert len(set(keys)) == 3


def test_parent_continues_a_chain_and_numpy_equals_list():
    toks = np.arange(48, dtype=np.int64)
    full = chain_keys(toks, 8)
    assert chain_keys(toks[24:], 8, parent=full[2]) == full[3:]
    assert chain_keys(list(range(48)), 8) == full


def test_namespace_separates_models():
    toks = list(range(16))
    assert chain_keys(toks, 8, namespace=b"model-a") != chain_keys(toks, 8, namespace=b"model-b")


def test_bad_tokens_rejected():
    with pytest.raises(ValueError):
        chain_keys([-1, 2], 1)
    with pytest.raises(ValueError):
        chain_keys([2**32], 1)
    with pytest.raises(ValueError):
        chain_keys([1.5, 2.0], 1)


@pytest.mark.parametrize(
    "bad",
    ["../../etc/passwd", "", "A" * 32, "0" * 31, "0" * 33, "0" * 31 + "/", "0" * 32 + "\n", ".tmp-" + "0" * 27, None, 5, b"0" * 32],
)
def test_bad_keys_rejected(bad):
    assert not is_valid_key(bad)
    with pytest.raises(BadKeyError):
        check_key(bad)


@settings(max_examples=60, deadline=None)
@given(
    prefix=st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=40),
    tail_a=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=20),
    tail_b=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=20),
    bs=st.integers(1, 8),
)
def test_keys_depend_exactly_on_the_prefix(prefix, tail_a, tail_b, bs):
    ka, kb = chain_keys(prefix + tail_a, bs), chain_keys(prefix + tail_b, bs)
    shared = len(prefix) // bs
    assert ka[:shared] == kb[:shared]
    # Block j's key equals iff all tokens up to the end of block j are equal.
    a, b = prefix + tail_a, prefix + tail_b
    for j in range(min(len(ka), len(kb))):
        assert (ka[j] == kb[j]) == (a[: (j + 1) * bs] == b[: (j + 1) * bs])


def test_striping_is_deterministic_and_spreads():
    keys = chain_keys(np.arange(4 * 3000), 4)
    counts = [0, 0, 0]
    for k in keys:
        counts[server_index(k, 3)] += 1
    assert [server_index(k, 3) for k in keys[:50]] == [server_index(k, 3) for k in keys[:50]]
    assert min(counts) > 800  # 1000 expected each
    groups = group_by_server(keys[:100], 3)
    assert sorted(p for g in groups.values() for p in g) == list(range(100))
    with pytest.raises(ValueError):
        server_index(keys[0], 0)
