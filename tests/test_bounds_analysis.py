"""The bottleneck-free P/D bounds: the paper's (with the article's erratum) and the testbed's own,
by one method over two sets of resources; the ranges of the shipped topologies; `dualpath topo`."""
from __future__ import annotations

import itertools
import math

import pytest

from dualpath.accounting import Nic
from dualpath.analysis import method
from dualpath.analysis.bounds import paper_model, pd_bounds, pe_read_condition_holds
from dualpath.analysis.testbed_bounds import SNIC_RX, hit_counts
from dualpath.analysis.testbed_bounds import testbed_model as build_model  # not test_*: pytest would collect it
from testbed.topology import load_topology
from tests.conftest import REPO, dualpath


# ---------------------------------------------------------------------------------- the paper's


def test_paper_range_for_g8_s1_is_one_seventh_to_seven_halves():
    rng = method.pd_range(paper_model(8, 1.0, 10.0))  # B = 50 GB/s, M = 500 GB/s: M/B = 10
    assert rng.lower == pytest.approx(1 / 7) and rng.upper == pytest.approx(7 / 2)
    assert rng.lower_by == ("PE CNIC write",)
    assert set(rng.upper_by) == {"DE CNIC write", "DE DRAM"}  # the article: both set 7/2
    assert {b.resource: b.value for b in rng.bounds if b.kind == "upper"}["DE CNIC read"] == pytest.approx(6)
    assert method.format_range(rng) == "1/7 <= P/D <= 7/2 (lower: PE CNIC write; upper: DE CNIC write, DE DRAM)"
    assert pd_bounds(8, 1.0, 10.0) == pytest.approx((1 / 7, 7 / 2))


def test_g2_s_quarter_keeps_the_papers_range():
    """DESIGN.md section 3: the bounds depend on s/g, so the shipped g = 2, s = 0.25 keep 1/7..7/2."""
    rng = method.pd_range(paper_model(2, 0.25, 2.5))
    assert (rng.lower, rng.upper) == pytest.approx((1 / 7, 7 / 2))


@pytest.mark.parametrize("g, s, m", list(itertools.product((1, 2, 4, 8), (0.05, 0.25, 0.5, 1.0, 1.5), (2.0, 5.0, 10.0, 40.0))))
def test_the_method_reproduces_the_closed_form(g, s, m):
    rng = method.pd_range(paper_model(g, s, m))
    lo, hi = pd_bounds(g, s, m)
    ratio_free = pe_read_condition_holds(g, s) and 2 * s <= m  # the PE CNIC read and PE DRAM conditions
    if ratio_free and 0 < lo <= hi:
        assert rng.feasible and (rng.lower, rng.upper) == pytest.approx((lo, hi))
    else:  # no P/D is bottleneck-free, by either
        assert not rng.feasible


def test_erratum_pe_read_is_s_at_most_g_over_2_not_g():
    """The paper states the PE CNIC read condition as s <= g; counted out it is 2s/g <= 1."""
    assert pe_read_condition_holds(2, 1.0) and not pe_read_condition_holds(2, 1.5)
    ok = {b.resource: b.kind for b in method.pd_range(paper_model(2, 1.0, 100)).bounds}
    assert ok["PE CNIC read"] == "always"  # s = g/2: exactly at the rate
    bad = method.pd_range(paper_model(2, 1.5, 100))  # s <= g (the paper's text) holds, s <= g/2 does not
    assert "PE CNIC read" in bad.failing and not bad.feasible
    assert "PE CNIC read" in method.format_range(bad)
    u = method.utilizations(paper_model(2, 1.5, 100), 1, 1)
    assert u["PE CNIC read"] == pytest.approx(1.5)


# ---------------------------------------------------------------------------------- the testbed's


# Hit bytes per hit byte read, on the PE path and the DE path, per (side, NIC kind, direction):
# DESIGN.md section 7's table with M = W = 0, written out by hand (not derived).
TESTBED_COUNTS = {
    ("pe", "snic", "rx"): (1, 0), ("de", "snic", "rx"): (0, 1),
    ("pe", "host_port", "tx"): (1, 0), ("pe", "cnic", "rx"): (1, 1), ("pe", "cnic", "tx"): (1, 0),
    ("de", "host_port", "rx"): (1, 0), ("de", "host_port", "tx"): (1, 2), ("de", "cnic", "rx"): (1, 1),
    ("storage", "storage_nic", "tx"): (1, 1),
}


def test_testbed_counts_come_from_the_paths():
    got = hit_counts()
    for nic in Nic:
        for d in ("rx", "tx"):
            key = (nic.side, nic.kind, d)
            assert got[key] == TESTBED_COUNTS.get(key, (0, 0)), key


def closed_form(g: float, s: float, h: float) -> tuple[float, float]:
    """The testbed's range in units of B with host port h (= min(g, M/B)), derived by hand from
    TESTBED_COUNTS: PE CNIC rx s(1 + D/P) <= g; DE host port tx s(P/D + 2) <= h; DE host port rx
    s P/D <= h; DE CNIC rx s(P/D + 1) <= g; PE CNIC tx and PE host port tx: s <= g, s <= h."""
    lower = s / (g - s)
    upper = min(h / s - 2, h / s, (g - s) / s)
    return lower, upper


@pytest.mark.parametrize("g, s, h", [(2, 0.25, 2), (2, 0.075, 2), (1, 0.25, 1), (8, 1, 8), (8, 1, 5), (4, 0.5, 1.5),
                                     (2, 0.25, 0.75)])
def test_testbed_range_matches_its_closed_form(g, s, h):
    B = 1e9
    rng = method.pd_range(build_model(g, B, s * B, h * B, 1e3 * B))
    lo, hi = closed_form(g, s, h)
    assert rng.lower == pytest.approx(lo) and rng.upper == pytest.approx(hi)
    assert rng.lower_by == ("PE CNIC rx",) and rng.upper_by == ("DE host port tx",)


def test_testbed_range_differs_from_the_papers_for_the_same_numbers():
    """g = 2, s = 0.25, M = 10 sB: the paper 1/7..7/2; the testbed's links 1/7..6 (DE host port tx)."""
    B = 1e9
    rng = method.pd_range(build_model(2, B, 0.25 * B, 2 * B, B))
    assert (rng.lower, rng.upper) == pytest.approx((1 / 7, 6))
    assert method.format_range(rng) == "1/7 <= P/D <= 6 (lower: PE CNIC rx; upper: DE host port tx)"
    (limit,) = rng.cluster_limits  # one storage NIC of B: at most 4 nodes' SNICs of B/4
    assert limit.resource == "storage NIC tx" and limit.describe() == "storage NIC tx: P+D <= 4"
    assert limit.holds(2, 2) and not limit.holds(4, 1)
    assert method.pd_range(paper_model(2, 0.25, 2.5)).upper == pytest.approx(7 / 2)  # the same numbers, the paper's


# Per shipped topology: the testbed's own (lower, upper), its storage-NIC limit on P+D, and the
# resource predicted to saturate first at its own P and D. Hand-computed from closed_form.
SHIPPED = {
    "1p1d": ((1 / 7, 6), 4, SNIC_RX),
    "1p2d": ((1 / 7, 6), 4, SNIC_RX),
    "2p1d": ((1 / 7, 6), 4, SNIC_RX),
    "2p4d": ((1 / 7, 6), 8, SNIC_RX),  # two storage servers
    "4p1d-out-of-range": ((1 / 7, 6), 4, "storage NIC tx"),  # inside the testbed's P/D range, but 5 SNICs > 1 storage NIC
    "1p1d-io": ((0.075 / 1.925, 2 / 0.075 - 2), 1 / 0.075, SNIC_RX),
    "1p1d-io-mooncake": ((0.075 / 1.925, 2 / 0.075 - 2), 1 / 0.075, SNIC_RX),  # 1p1d-io's links, Mooncake Store
    "1p2d-io": ((0.05 / 1.95, 38), 20, SNIC_RX),
    "2p1d-io": ((0.05 / 1.95, 38), 20, SNIC_RX),
    "1p1d-bounds": ((1 / 3, 2), 16, SNIC_RX),  # the P/D sweep's base: g = 1
    "1p1d-isolation": ((1 / 7, 6), 4, SNIC_RX),  # 1p1d's links, collectives on
    "1p1d-rxe": ((1 / 7, 6), 4, SNIC_RX),  # 1p1d's links, for the Soft-RoCE VM
    "1p1d-docker": ((1 / 7, 6), 4, SNIC_RX),  # 1p1d's links, in containers
    "1p1d-hbm": ((1 / 7, 6), 4, SNIC_RX),  # 1p1d's links, DS 660B with its HBM over the length scale
}


def test_every_shipped_topology_has_an_expected_range():
    assert {p.stem for p in (REPO / "topologies").glob("*.yaml")} == set(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_topology_testbed_range(name):
    (lo, hi), max_nodes, first = SHIPPED[name]
    t = load_topology(REPO / "topologies" / f"{name}.yaml")
    rng = t.testbed_range()
    assert (rng.lower, rng.upper) == pytest.approx((lo, hi))
    (limit,) = rng.cluster_limits
    assert limit.cap / limit.pe_weight == pytest.approx(max_nodes)
    assert t.predicted_bottleneck() == first
    assert rng.contains(t.pd_ratio)  # every shipped P/D is inside the testbed's own range ...
    assert t.in_bottleneck_free_range() == (name != "4p1d-out-of-range")  # ... the paper's is stricter


def sweep_model() -> method.Model:
    """g = 1, s = 0.25, host port g*B, storage NICs 4B: the P/D sweep's numbers, range 1/3..2."""
    B = 1e9
    return build_model(1, B, 0.25 * B, B, 4 * B)


@pytest.mark.parametrize("p, d, first", [(1, 4, "PE CNIC rx"), (1, 2, SNIC_RX), (2, 3, SNIC_RX), (1, 1, SNIC_RX),
                                         (3, 1, "DE host port tx"), (2, 1, SNIC_RX), (1, 3, SNIC_RX)])
def test_sweep_points_predictions(p, d, first):
    m = sweep_model()
    assert method.first_saturating(m, p, d) == first
    shares = method.expected_shares(m, p, d)
    assert shares[first] == pytest.approx(1.0) and max(shares.values()) == pytest.approx(1.0)


def test_at_a_range_edge_two_resources_saturate_together():
    m = sweep_model()
    assert set(method.co_saturating(m, 2, 1)) == {SNIC_RX, "DE host port tx"}  # P/D = 2: the upper bound
    assert set(method.co_saturating(m, 1, 3)) == {SNIC_RX, "PE CNIC rx"}  # P/D = 1/3: the lower bound
    assert method.first_saturating(m, 2, 1) == SNIC_RX  # ties go to the premise


def test_outside_the_range_the_premise_breaks_by_the_predicted_margin():
    m = sweep_model()
    assert method.utilizations(m, 1, 4)["PE CNIC rx"] == pytest.approx(1.25)
    assert method.expected_shares(m, 1, 4)[SNIC_RX] == pytest.approx(0.8)
    assert method.utilizations(m, 3, 1)["DE host port tx"] == pytest.approx(1.25)
    assert method.expected_shares(m, 3, 1)["DE CNIC rx"] == pytest.approx(0.8)


# ---------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("p, d", [(0, 1), (1, 0), (-1, 2), (math.nan, 1), (1, math.inf), ("2", 1)])
def test_bad_node_counts_are_one_line_errors(p, d):
    with pytest.raises(ValueError) as e:
        method.utilizations(paper_model(8, 1, 10), p, d)
    assert "\n" not in str(e.value) and "positive number of nodes" in str(e.value)


def test_bad_resources_and_models_are_refused():
    with pytest.raises(ValueError, match="side 'nowhere'"):
        method.Resource("x", "nowhere", 1, 1, 1, 1)
    with pytest.raises(ValueError, match="rate must be finite and > 0"):
        method.Resource("x", "pe", 1, 0, 1, 1)
    with pytest.raises(ValueError, match="pe_path must be finite and >= 0"):
        method.Resource("x", "pe", 1, 1, -1, 1)
    with pytest.raises(ValueError, match="SNIC resource 'nope'"):
        method.Model("m", 1.0, (method.Resource("x", "pe", 1, 1, 1, 1),), "nope")
    with pytest.raises(ValueError, match="host_port_bps must be > 0"):
        build_model(2, 1e9, 1e8, 0, 1e9)


def test_ratio_strings():
    assert [method.ratio_str(x) for x in (1 / 7, 7 / 2, 6.0, 1 / 3, 24.6667, math.inf)] == \
        ["1/7", "7/2", "6", "1/3", "24.7", "inf"]


# ---------------------------------------------------------------------------------- dualpath topo


def test_cli_topo_prints_both_ranges_and_the_predicted_bottleneck():
    r = dualpath("topo", str(REPO / "topologies" / "4p1d-out-of-range.yaml"))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "P/D=4 is OUTSIDE the paper's bottleneck-free range [0.143, 3.5]" in out
    assert "testbed's own range (its links, each direction): 1/7 <= P/D <= 6 (lower: PE CNIC rx; upper: DE host port tx)" in out
    assert "storage NIC tx: P+D <= 4 (5 nodes: EXCEEDED)" in out
    assert "predicted to saturate first here: storage NIC tx (at 1.25 of its rate" in out


def test_cli_topo_on_the_sweep_base():
    r = dualpath("topo", str(REPO / "topologies" / "1p1d-bounds.yaml"))
    assert r.returncode == 0, r.stderr
    assert "1/3 <= P/D <= 2" in r.stdout and "predicted to saturate first here: SNIC rx" in r.stdout
