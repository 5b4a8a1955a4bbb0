"""`dualpath reproduce bounds`: the sweep's plan, the measurement from hand-built run folders with
known answers (links.jsonl counters, records), and summary.json's interface."""
from __future__ import annotations

import json

import pytest

from dualpath.analysis.testbed_bounds import SNIC_RX
from testbed.reproduce import bounds, module, reproduce_id
from testbed.measure.runs import load_run
from tests.reproduce_helpers import RunFolder, is_valid_png, plan_json

RATES = {"snic": 20e6, "cnic": 80e6, "host_port": 80e6, "storage_nic": 320e6}  # 1p1d-bounds, bit/s


def links(cfg, shares: dict[tuple[str, str, int], float], t_end: float = 30.0, dt: float = 0.25) -> list[dict]:
    """Monitor samples whose counters grow at share x rate: shares[(role letter, kind, 0 rx / 1 tx)]."""
    names = bounds.nic_roles(cfg.topology_obj())
    out = []
    for i in range(int(t_end / dt) + 1):
        t = i * dt
        nics = {}
        for name, (role, kind, rate) in names.items():
            letter = {"prefill": "p", "decode": "d", "storage": "s"}[role]
            nics[name] = [int(shares.get((letter, kind, c), 0.0) * rate / 8 * t) for c in (0, 1)]
        out.append({"t": t, "cpu_busy": 0.3, "nics": nics})
    return out


def agents(n: int, first_done: float = 2.0, last_end: float = 28.0) -> list[dict]:
    """n agents of 3 turns: every first turn is done by first_done; agent i ends at last_end - i/2
    ... spread so the window closes when a quarter have ended."""
    rows = []
    for a in range(n):
        end = last_end - (n - 1 - a) * 0.5
        for turn, done in enumerate((first_done - 0.1 * a / n, (first_done + end) / 2, end)):
            rows.append({"request": f"t{a}-r{turn}", "trajectory": a, "turn": turn, "t_arrive": 0.0,
                         "t_done": done, "error": ""})
    rows.append({"request": "warm", "trajectory": -1, "turn": 0, "t_arrive": -1.0, "t_done": -0.5, "error": ""})
    return rows


INSIDE = {("p", "snic", 0): 0.95, ("d", "snic", 0): 0.95, ("p", "cnic", 0): 0.5, ("d", "host_port", 1): 0.72,
          ("d", "cnic", 0): 0.5, ("s", "storage_nic", 1): 0.12}
BELOW = {("p", "snic", 0): 0.8, ("d", "snic", 0): 0.8, ("p", "cnic", 0): 0.97, ("d", "host_port", 1): 0.45}
ABOVE = {("p", "snic", 0): 0.75, ("d", "snic", 0): 0.75, ("d", "host_port", 1): 0.96, ("d", "cnic", 0): 0.8}


def write_point(root, p: int, d: int, shares, faithful: bool = True, quick: bool = True):
    cfg = bounds.config(p, d, quick)
    f = RunFolder(root / cfg.folder(), dilation=9.77, topology=cfg.topology_obj().name)
    f.mode(bounds.MODE, faithful=faithful, records=agents(8), links=links(cfg, shares))
    return f.write(plan=plan_json(cfg))


def test_plan_sweeps_below_inside_and_above_the_testbeds_range():
    for quick in (True, False):
        plan = bounds.plan(quick)
        rows = [bounds.point(c, None) for c in plan.configs]
        assert [(r["p"], r["d"]) for r in rows] == list(bounds.POINTS)
        inside = [r["inside"] for r in rows]
        assert inside.count(True) >= 3 and inside.count(False) >= 2
        ratios = [r["ratio"] for r in rows]
        lo, hi = bounds.ranges()["range"]["lower"], bounds.ranges()["range"]["upper"]
        assert min(ratios) < lo and max(ratios) > hi  # one below, one above
        assert [r["predicted"] for r in rows] == ["PE CNIC rx", SNIC_RX, SNIC_RX, SNIC_RX, "DE host port tx"]
        for c in plan.configs:  # a valid topology, its P and D as the point says, one mode
            t = c.topology_obj()
            assert (t.spec.prefill_nodes, t.spec.decode_nodes) == (c.params["p"], c.params["d"]) and c.modes == ("dualpath",)
    assert bounds.plan(True).estimate_s() <= 900  # every turn, so that each loaded window holds 20 windows


def test_loaded_window_from_first_turns_to_a_quarter_finished():
    recs = agents(8, first_done=2.0, last_end=28.0)
    t0, t1 = bounds.loaded_window(recs)
    assert t0 == pytest.approx(2.0)  # the last agent's first turn
    assert t1 == pytest.approx(28.0 - 5 * 0.5)  # 2 of 8 agents (a quarter) have ended by then
    assert bounds.loaded_window([]) is None
    assert bounds.loaded_window([{"trajectory": 0, "turn": 0, "t_done": 5.0, "error": ""}]) is None  # no span


def test_utilizations_from_counters(tmp_path):
    cfg = bounds.config(1, 1, True)
    samples = links(cfg, INSIDE)
    util = bounds.utilizations(samples, bounds.nic_roles(cfg.topology_obj()), cfg.topology_obj().testbed_model(), (2.1, 20.3))
    assert util[SNIC_RX] == pytest.approx(0.95, rel=1e-3)
    assert util["DE host port tx"] == pytest.approx(0.72, rel=1e-3) and util["PE CNIC rx"] == pytest.approx(0.5, rel=1e-3)
    assert util["storage NIC tx"] == pytest.approx(0.12, rel=1e-3) and util["PE host port rx"] == 0
    assert bounds.measured_bottleneck(util) == SNIC_RX
    assert bounds.measured_bottleneck({"a": 0.89, "b": 0.5}) is None
    assert bounds.utilizations(samples[:1], {}, cfg.topology_obj().testbed_model(), (0, 1)) == {}


def test_snic_utilization_is_every_nodes_snics_together(tmp_path):
    cfg = bounds.config(1, 2, True)
    shares = {("p", "snic", 0): 1.0, ("d", "snic", 0): 0.7}  # 1 PE SNIC full, 2 DE SNICs at 0.7
    util = bounds.utilizations(links(cfg, shares), bounds.nic_roles(cfg.topology_obj()),
                               cfg.topology_obj().testbed_model(), (1, 20))
    assert util[SNIC_RX] == pytest.approx((1.0 + 2 * 0.7) / 3, rel=1e-3)


def test_points_match_when_the_measured_bottleneck_is_the_predicted_one(tmp_path):
    for (p, d), shares in (((1, 1), INSIDE), ((1, 4), BELOW), ((3, 1), ABOVE)):
        cfg = bounds.config(p, d, True)
        row = bounds.point(cfg, load_run(write_point(tmp_path, p, d, shares)))
        assert row["match"] and row["measured"] == row["predicted"], row
        assert row["window_s"] == [pytest.approx(2.0), pytest.approx(25.5)] and row["faithful"]
    # an above-range point whose DE host port never reached 0.9: no measured bottleneck, no match
    cfg = bounds.config(3, 1, True)
    row = bounds.point(cfg, load_run(write_point(tmp_path / "x", 3, 1, {**ABOVE, ("d", "host_port", 1): 0.85})))
    assert row["measured"] is None and not row["match"]
    assert row["most_utilized"] == "DE host port tx"  # it leads, short of the rate: reported, still no match
    result = bounds.reproduce({cfg.key: load_run(tmp_path / "x" / cfg.folder())}, tmp_path / "out", quick=True)
    assert any(n.startswith("At 3P1D the predicted resource is the most utilised but stays under 0.9 of its rate "
                            "(those runs are FAITHFUL") for n in result.notes)


def test_reproduce_writes_the_interface_the_checks_read(tmp_path):
    root = tmp_path / "runs"
    per = {(1, 4): BELOW, (1, 2): INSIDE, (2, 3): INSIDE, (1, 1): INSIDE, (3, 1): ABOVE}
    for (p, d), shares in per.items():
        write_point(root, p, d, shares, faithful=(p, d) != (2, 3))
    folder, result = reproduce_id("bounds", quick=True, out_root=tmp_path / "out", command="test",
                                  run_folders=[root], progress=lambda m: None, run_id="r")
    s = json.loads((folder / "summary.json").read_text())
    assert s["faithful"] is False  # 2P3D was not
    assert s["range"]["lower"] == pytest.approx(1 / 3) and s["range"]["upper"] == pytest.approx(2)
    assert s["paper_range"]["upper"] == pytest.approx(1.5)
    assert [(x["p"], x["d"], x["inside"]) for x in s["points"]] == [
        (1, 4, False), (1, 2, True), (2, 3, True), (1, 1, True), (3, 1, False)]
    for x in s["points"]:
        assert x["measured"] == x["predicted"] == x["most_utilized"] and set(x["utilization"]) >= {SNIC_RX, "PE CNIC rx", "DE host port tx"}
        assert all(0 <= v <= 1.5 for v in x["utilization"].values())
    assert s["all_match"] and s["complete"]
    assert len(s["pngs"]) == 2 and all(is_valid_png(folder / p) for p in s["pngs"])
    report = (folder / "report.md").read_text()
    assert "| 1 | 4 | 1/4 | no | PE CNIC rx | PE CNIC rx | yes |" in report and "NOT FAITHFUL" in report


def test_reproduce_without_runs_says_what_is_missing(tmp_path):
    (tmp_path / "empty").mkdir()
    plan = module("bounds").plan(True)
    result = module("bounds").reproduce({}, tmp_path, quick=True)
    assert not result.faithful and not result.pngs
    assert all(p["measured"] is None and not p["match"] for p in result.data["points"])
    assert len(result.data["points"]) == len(plan.configs) and not result.data["all_match"]
