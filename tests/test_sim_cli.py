"""`dualpath sim`: a run folder with the summary keys of `dualpath run`, one-line refusals of bad
input, and the validation arithmetic (fits, stages, aggregate) on hand-made inputs."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from testbed.sim import fit as sf
from testbed.sim import validate as sv
from testbed.sim import validation_report as sr
from tests.conftest import REPO


def dualpath(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "testbed.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_sim_writes_a_summary_with_the_run_keys(tmp_path):
    p = dualpath("sim", str(REPO / "topologies" / "1p1d-io.yaml"), "--modes", "basic,dualpath",
                 "--trajectories", "3", "--calibration", str(tmp_path / "none.json"), "--out", str(tmp_path),
                 cwd=tmp_path)
    assert p.returncode == 2 and "not a calibration file" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    p = dualpath("sim", str(REPO / "topologies" / "1p1d-io.yaml"), "--modes", "basic,dualpath",
                 "--trajectories", "3", "--out", str(tmp_path), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    (folder,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    s = json.loads((folder / "summary.json").read_text())
    assert s["command"].startswith("dualpath sim") and s["faithful"] is True
    for m in ("basic", "dualpath"):
        assert {"jct_s", "ttft_s", "tpot_s", "snic_max_over_avg"} <= s["modes"][m].keys()
    assert s["modes"]["dualpath"]["speedup_over_basic"] > 1
    assert (folder / "records.jsonl").exists() and (folder / "report.md").exists()


@pytest.mark.parametrize("args, words", [
    (("sim", "topologies/1p1d-io.yaml", "--modes", "basic,fast"), ("unknown mode", "fast")),
    (("sim",), ("name a topology",)),
    (("sim", "--validate", "--calibration", "x.json"), ("--runs",)),
    (("sim", "--calibrate", "/nonexistent-run"), ("not a run folder",)),
    (("sim", "topologies/1p1d-io.yaml", "--units", "gpu"), ("--units",)),
    (("sim", "topologies/1p1d-io.yaml", "--burst", "x"), ("--burst goes with --calibrate",)),
])
def test_bad_input_is_one_line(args, words, tmp_path):
    p = dualpath(*args, "--out", str(tmp_path))
    assert p.returncode == 2, p.stderr
    line = p.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line
    for w in words:
        assert w in line


def test_nnls_recovers_nonnegative_coefficients():
    rng = np.random.default_rng(0)
    X = np.column_stack([np.ones(50), rng.uniform(1, 5, 50), rng.uniform(0, 1, 50)])
    y = X @ np.array([0.5, 0.0, 2.0])
    assert sf._nnls(X, y) == pytest.approx([0.5, 0.0, 2.0], abs=1e-9)
    # the unconstrained fit would go negative on the middle column: held at 0
    assert sf._nnls(X, y - 0.1 * X[:, 1])[1] == 0.0


def test_levenberg_marquardt_finds_the_nonnegative_least_squares_point():
    """The latencies' fit: residuals (x0 - 0.3, x1 + 0.2, x0 + x1 - 0.1) are least at x1 = -0.25,
    which no latency can be; held at 0, x0 = 0.2 is the best."""
    def res(x):
        return np.array([x[0] - 0.3, x[1] + 0.2, x[0] + x[1] - 0.1])

    x, r, evals = sf._levenberg_marquardt(res, np.array([1.0, 1.0]), 30, progress=lambda s: None)
    assert x == pytest.approx([0.2, 0.0], abs=1e-3) and evals > 3
    assert r == pytest.approx(res(x))


def test_a_rows_noise_is_the_standard_error_of_two_means():
    """sd 0.4 about a mean of 8 over 8 simulations, against 1 run: 0.05 x sqrt(1/8 + 1) = 0.053;
    against the mean of 3 runs it shrinks; one simulation has none."""
    sims = [7.6, 8.4] * 4
    sd = float(np.std(sims, ddof=1))
    assert sv.noise(sims, 1) == pytest.approx(sd / 8 * (1 / 8 + 1) ** 0.5, abs=1e-5)
    assert sv.noise(sims, 3) < sv.noise(sims, 1)
    assert sv.noise([8.0], 3) is None and sv.noise([None, None], 1) is None


def test_stages_split_a_request_into_its_phases():
    r = {"error": "", "t_arrive": 0.0, "t_read_start": 1.0, "t_read_end": 2.0, "t_prefill_start": 2.0,
         "t_first_token": 3.5, "token_times": [3.5, 4.0, 4.2, 4.4], "t_done": 5.0}
    st = sf.stages([r])
    assert st == pytest.approx({"route": 1.0, "read": 1.0, "prefill": 1.5, "handover": 0.5, "tpot": 0.2, "writeback": 0.6})


def test_aggregate_judges_the_targets_and_the_held_out_rows_apart():
    def row(err, held, ttft=0.01, snic=0.0):
        return {"jct_err": err, "held_out": held, "ttft_p50_err": ttft, "ttft_p99_err": None, "tpot_p50_err": 0.0,
                "snic_balance_diff": snic, "faithful": True}
    a = sv.aggregate([row(0.01, False), row(-0.03, True)])
    assert a["mean_jct_err"] == 0.02 and a["max_jct_err"] == 0.03 and a["held_out_mean_jct_err"] == 0.03
    assert a["meets_targets"]
    assert not sv.aggregate([row(0.01, False), row(0.06, True)])["meets_targets"]  # max > 5 %
    assert not sv.aggregate([row(0.01, False, ttft=0.08)])["meets_targets"]
    assert not sv.aggregate([row(0.01, False, snic=-0.06)])["meets_targets"]


def test_a_run_made_at_another_dilation_is_refused(tmp_path):
    """A committed run whose topology file has since changed its scale is not silently simulated
    at the new rates: the error names the run, both dilations and the fix."""
    from testbed.measure.runs import Run

    summary = {"topology": "1p1d-io", "dilation": 3.125, "time": {"kv_bytes_per_token": {"testbed": 2048}}, "modes": {}}
    run = Run(tmp_path, summary)
    from testbed.topology import load_topology

    now = load_topology(REPO / "topologies" / "1p1d-io.yaml").dilation(2048)
    assert now != pytest.approx(3.125)
    with pytest.raises(ValueError, match=r"dilation 3\.125.*1p1d-io\.yaml now gives.*run it again"):
        sf.run_topology(run)
    assert sf.run_topology(Run(tmp_path, {**summary, "dilation": now})).name == "1p1d-io"


def test_calibration_simulates_an_online_run_with_its_arrivals():
    """Fitting on an online run must simulate its Poisson arrivals, not start every agent at once:
    the simulated run then lasts at least until its last agent arrived."""
    from dualpath.workload import poisson_arrivals
    from simulator.calibration import Calibration
    from testbed.measure.runs import load_run

    run = load_run(REPO / "results" / "e2e" / "online-1p1d-io-1.5aps")
    assert run.aps == 1.5
    cal = Calibration.load(REPO / "simulator" / "calibration.json")
    st = sf._sim_stages(sf.run_topology(run), run, cal, ["basic"])["basic"]
    last = max(poisson_arrivals(run.summary["trajectories"], run.aps, sf.arrival_seed(run))) * run.dilation
    assert st["jct"] > last > run.mode("basic")["jct_testbed_s"] * 0.8


def test_held_out_rows_are_judged_by_the_configuration_not_its_name():
    """A calibration records each run's configuration (topology contents, workload, arrivals):
    a run of one of them is not held out whatever made it (fig9's x1 run under a reproduce
    topology name is the ladder's configuration), and another workload or topology is. A
    calibration without the records is judged by (topology name, online) alone."""
    from simulator.calibration import Calibration
    from testbed.measure.runs import load_run

    e2e = REPO / "results" / "e2e"
    ladder, online = load_run(e2e / "ladder-1p1d-io"), load_run(e2e / "online-1p1d-io-1.5aps")
    same_as_ladder, longer_appends = load_run(e2e / "fig9-appendx1"), load_run(e2e / "fig9-appendx4")
    other_topology = load_run(e2e / "ladder-1p2d-io")
    assert same_as_ladder.topology != ladder.topology  # "1p1d-io-scale0.0016": its plan's overrides
    both = Calibration(source={"runs": [{"topology": r.topology, "aps": r.aps or 0.0, "config": sf.config_identity(r)}
                                        for r in (ladder, online)]})
    assert [sv.held_out(r, both) for r in (ladder, online, same_as_ladder, longer_appends, other_topology)] == \
        [False, False, False, True, True]
    old = Calibration(source={"topology": "1p1d-io", "aps": 0.0, "runs": [
        {"topology": "1p1d-io", "aps": 0.0}, {"topology": "1p1d-io", "aps": 1.5}]})
    assert [sv.held_out(r, old) for r in (ladder, online, other_topology)] == [False, False, True]
    assert sv.held_out(ladder, Calibration(source={"topology": "1p1d-io", "aps": 1.5})) is True
    # repeats are grouped by configuration too
    assert sv.group_repeats([ladder, longer_appends, same_as_ladder]) == [[ladder, same_as_ladder], [longer_appends]]
    # and a calibration may mix runs of one cluster under both names (its one-topology rule)
    assert sf.topology_contents(same_as_ladder) == sf.topology_contents(ladder) != sf.topology_contents(other_topology)


def test_calibration_refuses_runs_of_two_topologies_before_fitting(tmp_path):
    """Held-out rows are judged by configuration, so a fit over two topologies would leave none
    to hold out honestly: refused with both names, before any simulation."""
    from testbed.measure.runs import Run

    def run(topo: str) -> Run:
        return Run(tmp_path / topo, {"topology": topo, "modes": {"basic": {"faithful": True}}})

    with pytest.raises(ValueError, match=r"share one topology.*1p1d-io, 1p2d-io"):
        sf.calibrate([run("1p1d-io"), run("1p2d-io")], progress=lambda s: None)
    unfaithful = Run(tmp_path / "u", {"topology": "1p1d-io", "modes": {"basic": {"faithful": False}}})
    with pytest.raises(ValueError, match="not FAITHFUL"):
        sf.calibrate([run("1p1d-io"), unfaithful], progress=lambda s: None)


def test_a_median_between_two_modes_is_named_in_the_report():
    """Round-robin's TTFTs are two modes of equal size (PE-side and DE-side reads): the median falls
    in the gap, where one request moves it. The row keeps its error (the targets still judge it) and
    the report names the gap with the quantiles around it; a unimodal row gets no such line."""
    from simulator.calibration import Calibration

    two_modes = [0.5 + 0.01 * i for i in range(50)] + [1.8 + 0.01 * i for i in range(50)]
    one_mode = [0.5 + 0.01 * i for i in range(100)]
    assert sv.median_gap(two_modes)[2] > sv.MEDIAN_GAP > sv.median_gap(one_mode)[2]

    def recs(ts, slow_path=1.0):  # the lower half read on the PE side, the upper on the DE side
        return [{"error": "", "t_arrive": 1.0, "path": "pe" if t < 1.5 else "de",
                 "token_times": [1.0 + (t if t < 1.5 else t * slow_path), 9.0]} for t in ts]

    def row(mode, ts, slow_path=1.0):
        return {"config": "1p2d-io", "mode": mode, "held_out": True, "faithful": True,
                "jct_s": {"testbed": 8.0, "sim": 8.0}, "jct_err": 0.0, "ttft_p50_err": 0.4 if ts is two_modes else 0.0,
                "ttft_p99_err": 0.0, "tpot_p50_err": 0.0, "snic_max_over_avg": {"testbed": 1.5, "sim": 1.5},
                "snic_balance_diff": 0.0, **sv._median_modes(recs(ts), recs(ts, slow_path), 1.0)}

    rows = [row("dualpath-rr", two_modes, slow_path=1.1), row("basic", one_mode)]  # simulated DE reads 10 % slower
    assert [r["ttft_p50_between_modes"] for r in rows] == [True, False]
    text = "\n".join(sr.report_lines("cmd", Calibration(source={"run": "r"}), rows, sv.aggregate(rows)))
    assert "1p2d-io dualpath-rr: its testbed TTFT median lies between two modes (p45 0.946 s, p55 1.84 s" in text
    assert "1p2d-io basic:" not in text and "NOT met" in text
    # each path's own median beside it
    per_path = rows[0]["ttft_p50_per_path_s"]
    assert per_path["pe"] == {"testbed": 0.745, "sim": 0.745, "err": 0.0}
    assert per_path["de"]["err"] == pytest.approx(0.1)
    assert "ttft_p50_per_path_s" not in rows[1]  # a unimodal row has none
    assert "each read path's own median (testbed, simulated): DE path 2.04 s against 2.25 s (+10.0%); PE path " \
        "0.745 s against 0.745 s (+0.0%)" in text


def test_the_report_warns_when_the_runs_come_from_different_code():
    """Validation once compared ladders made before a change to the model with an online run made
    after it (a pass's compute differed by 2x): the report names each run's commit and warns when
    they differ or a run was made on uncommitted changes; runs that record none are said to."""
    a, b = "a" * 40, "b" * 40
    same = sr.code_lines({"r1": {"commit": a, "dirty": False}, "r2": {"commit": a, "dirty": False}})
    assert len(same) == 1 and "aaaaaaaaaaaa" in same[0]
    two = sr.code_lines({"r1": {"commit": a, "dirty": False}, "r2": {"commit": b, "dirty": False}})
    assert two[1].startswith("WARNING: the runs come from 2 commit(s)")
    dirty = sr.code_lines({"r1": {"commit": a, "dirty": True}, "r2": None})
    assert "(dirty)" in dirty[0] and "1 run(s) record none" in dirty[0] and "uncommitted changes" in dirty[1]
    assert sr.code_lines({"r1": None}) == ["Code: no run records the commit it was made on (made before runs "
                                           "recorded it)."]


def test_the_report_says_whether_the_calibration_was_fitted_on_the_runs_code(tmp_path):
    """A calibration fitted on runs 226 commits older than the runs it was validated against
    modelled a testbed that was gone (every lightly loaded pass came out long): the report says
    whether the calibration's runs, read from the folders it names, were made on the same code."""
    from simulator.calibration import Calibration

    a, b = "a" * 40, "b" * 40
    runs = {"r1": {"commit": a, "dirty": False}}
    assert sr.code_lines(runs, {"c": {"commit": a, "dirty": False}})[-1] == "Calibration: fitted on runs of the same code."
    other = sr.code_lines(runs, {"c": {"commit": b, "dirty": False}})
    assert other[-1].startswith("WARNING: the calibration was fitted on runs of bbbbbbbbbbbb") and len(other) == 2
    assert "record no commit" in sr.code_lines(runs, {"c": None})[-1]
    assert "record no commit" in sr.code_lines({"r1": None}, {})[-1]
    assert sr.code_lines(runs) == sr.code_lines(runs, None) == sr.code_lines(runs)[:1]  # no calibration, no line
    (tmp_path / "c1").mkdir()
    (tmp_path / "c1" / "summary.json").write_text(json.dumps({"code": {"commit": a, "dirty": False}}))
    cal = Calibration(source={"runs": [{"run": str(tmp_path / "c1")}, {"run": str(tmp_path / "gone")}]})
    assert sr.calibration_codes(cal) == {str(tmp_path / "c1"): {"commit": a, "dirty": False}, str(tmp_path / "gone"): None}
    # the committed calibration names runs in the repository that record their code
    committed = Calibration.load(REPO / "simulator" / "calibration.json")
    codes = sr.calibration_codes(committed)
    assert codes and all(codes.values())


def test_the_report_names_a_row_whose_prediction_moves_more_than_its_target():
    """Round-robin on 1p2d-io once moved its JCT from -5.8 % to +1.9 % when one write-back latency
    moved by 10 %: the order of events, not the rates, placed it. Every row gets the band of its
    prediction over the fitted latencies moved one at a time; a band wider than the target is named."""
    from simulator.calibration import Calibration

    cal = Calibration(rpc_s=1e-3, flush_fixed_s=2e-3, source={"run": "r"})
    nudged = sv.nudged_calibrations(cal)
    assert sorted(c.rpc_s for c in nudged) == pytest.approx([0.9e-3, 1e-3, 1e-3, 1.1e-3])
    assert sorted(c.flush_fixed_s for c in nudged) == pytest.approx([1.8e-3, 2e-3, 2e-3, 2.2e-3])
    assert all(c.pass_fixed_s == 0 for c in nudged)  # a latency the fit left at 0 is not moved
    assert sv.spread([8.0, 8.4, 7.8], 8.0) == 0.075 and sv.spread([None, None], 8.0) is None

    def row(mode, jct_band, ttft_band):
        return {"config": "1p2d-io", "mode": mode, "held_out": True, "faithful": True,
                "jct_s": {"testbed": 8.0, "sim": 8.0}, "jct_err": 0.0, "ttft_p50_err": 0.0, "ttft_p99_err": 0.0,
                "tpot_p50_err": 0.0, "snic_max_over_avg": {"testbed": 1.5, "sim": 1.5}, "snic_balance_diff": 0.0,
                "jct_spread": jct_band, "ttft_p50_spread": ttft_band}

    rows = [row("dualpath-rr", 0.077, 0.2), row("dualpath", 0.01, 0.02)]
    agg = sv.aggregate(rows)
    assert agg["max_jct_spread"] == 0.077 and agg["max_ttft_p50_spread"] == 0.2
    text = "\n".join(sr.report_lines("cmd", cal, rows, agg))
    assert "1p2d-io dualpath-rr: JCT band +7.7%, TTFT p50 band +20.0%: wider than the target" in text
    assert "1p2d-io dualpath:" not in text and "over the 5 simulations" in text


def test_repeats_of_one_configuration_are_compared_as_their_mean(tmp_path):
    """The testbed's offline JCT moves by ~5 % between two runs of one configuration (the order of
    events): repeats are grouped by configuration and a row compares the simulation with their mean,
    listing each; a run of another workload is a configuration of its own."""
    import shutil

    from simulator.calibration import Calibration
    from testbed.measure.runs import load_run

    src = REPO / "results" / "e2e" / "repeat-1p2d-io-rr-1"

    def copy(name, jct, **workload):
        d = tmp_path / name
        shutil.copytree(src, d)
        s = json.loads((d / "summary.json").read_text())
        s["modes"]["dualpath-rr"]["jct_s"] = jct
        s["workload"] = {**s["workload"], **workload}
        (d / "summary.json").write_text(json.dumps(s))
        return load_run(d)

    a, b = copy("a", 8.0), copy("b", 9.0)
    other = copy("c", 8.0, n_trajectories=s_traj(src) - 1)
    groups = sv.group_repeats([a, other, b])
    assert [[r.path.name for r in g] for g in groups] == [["a", "b"], ["c"]]
    cal = Calibration.load(REPO / "simulator" / "calibration.json").exact()
    (rr,) = [r for r in sv.validate_config(groups[0], cal, progress=lambda s: None) if r["mode"] == "dualpath-rr"]
    assert rr["jct_s"]["testbed"] == 8.5 and rr["jct_s"]["testbed_runs"] == [8.0, 9.0]
    assert rr["jct_err"] == pytest.approx(rr["jct_s"]["sim"] / 8.5 - 1, abs=1e-4)
    assert rr["runs"] == [str(a.path), str(b.path)] and rr["replicas"] == 1


def s_traj(run_dir):
    return json.loads((run_dir / "summary.json").read_text())["workload"]["n_trajectories"]


def test_the_jitter_fit_recovers_the_jitter_of_simulated_requests(tmp_path):
    """Requests simulated with a known jitter stand in for a testbed run's: the fit finds that
    jitter back from how much their routing and write-back vary; requests of the exact model
    give 0."""
    import dataclasses
    import shutil

    from simulator.calibration import Calibration
    from testbed.measure.runs import load_run

    assert sf.dispersion([1.0] * 10) == 0.0 and sf.dispersion([1.0, 2.0]) is None
    # quartiles 2.5 and 7.5 (the exclusive method), median 5
    assert sf.dispersion(list(range(1, 10))) == pytest.approx((7.5 - 2.5) / 1.349 / 5)
    cal = Calibration.load(REPO / "simulator" / "calibration.json").exact()

    def run_with_records_of(jitter, seed, name):
        d = tmp_path / name
        shutil.copytree(REPO / "results" / "e2e" / "repeat-1p2d-io-rr-1", d)
        s = json.loads((d / "summary.json").read_text())
        s["modes"] = {"dualpath": s["modes"]["dualpath"]}
        (d / "summary.json").write_text(json.dumps(s))
        res = sf._run_sim(load_run(d), dataclasses.replace(cal, jitter=jitter), seed)[0]
        (d / "records.jsonl").write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in res["dualpath"].records))
        return load_run(d)

    fitted, how = sf.fit_jitter([run_with_records_of(0.8, 11, "j")], cal, seeds=2, iterations=7)
    assert fitted == pytest.approx(0.8, abs=0.25), how
    assert how["sim_mean_dispersion_without_jitter"] < how["testbed_mean_dispersion"]
    assert sf.fit_jitter([run_with_records_of(0.0, 11, "exact")], cal, seeds=2, iterations=7)[0] == 0.0


def test_the_burst_beyond_the_bucket_is_the_time_the_bucket_model_overstates(tmp_path):
    """48 Mbit/s, MTU 9000: a transfer that ends exactly when the bucket model says has sent
    nothing beyond it; one 5 ms sooner sent 5 ms of the rate more (payload). A burst folder of
    another topology, or no burst folder at all, is refused; a negative mean counts as 0."""
    from emulators.nic import burst_bytes
    from testbed.calibrate.benches.burst import extra_bytes
    from testbed.measure.fidelity import payload_share

    share, rate, n = payload_share(9000), 48e6, 1_200_000
    model = (n / share - burst_bytes(48_000_000, 9000)) * 8 / rate
    assert extra_bytes(n, model, rate, 9000) == pytest.approx(0, abs=1e-6)
    assert extra_bytes(n, model - 0.005, rate, 9000) == pytest.approx(0.005 * 6e6 * share)
    (tmp_path / "summary.json").write_text(json.dumps({"topology": "1p1d-io", "command": "dualpath bench burst", "kinds": {
        "snic": {"mean_extra_payload_bytes": 34153}, "host_port": {"mean_extra_payload_bytes": -33061}}}))
    extra, source = sf.burst_of(tmp_path, "1p1d-io")
    assert extra == {"snic": 34153.0, "host_port": 0.0} and source["measured_payload_bytes"]["host_port"] == -33061
    with pytest.raises(ValueError, match=r"measured on '1p1d-io'.*dualpath bench burst topologies/2p1d-io.yaml"):
        sf.burst_of(tmp_path, "2p1d-io")
    with pytest.raises(ValueError, match="not a `dualpath bench burst` folder"):
        sf.burst_of(tmp_path / "missing", "1p1d-io")
    (tmp_path / "other").mkdir()  # a `bench store` folder: no kinds
    (tmp_path / "other" / "summary.json").write_text(json.dumps({"topology": "1p1d-io", "kinds": {"snic": {}}}))
    with pytest.raises(ValueError, match="not a `dualpath bench burst` folder"):
        sf.burst_of(tmp_path / "other", "1p1d-io")


def test_a_reproduce_run_is_labelled_by_its_topology_file_and_folder():
    """Runs of `dualpath reproduce` all carry the derived topology name of their overrides; their
    validation rows must still say which workload each is."""
    from testbed.measure.runs import load_run

    e2e = REPO / "results" / "e2e"
    assert sf.run_label(load_run(e2e / "fig7-64K-4a-turns4")) == "1p1d-io fig7-64K-4a-turns4"
    assert sf.run_label(load_run(e2e / "online-1p1d-io-1.5aps")) == "1p1d-io@1.5aps"


def test_the_committed_fit_recognises_its_own_runs_after_later_topology_fields():
    """Fields added to topologies after a calibration recorded its runs (a connector, the store
    kind) leave a run's identity alone at their defaults, and change it when set."""
    import dataclasses

    from simulator.calibration import COMMITTED, Calibration
    from testbed.measure.runs import load_run

    cal = Calibration.load(COMMITTED)
    for name in ("ladder-1p1d-io", "online-1p1d-io-1.5aps"):
        assert not sv.held_out(load_run(REPO / "results" / "e2e" / name), cal), name
    run = load_run(REPO / "results" / "e2e" / "ladder-1p1d-io")
    base = sf.topology_contents(run)
    assert "store" not in base and "connector" not in base
    mooncake = dataclasses.replace(run, summary={**run.summary, "topology": "1p1d-io-mooncake"})  # Mooncake Store
    assert sf.topology_contents(mooncake)["store"] == "mooncake"
    assert sf.config_identity(mooncake) != sf.config_identity(run)
    assert "hbm_length_scale" not in base["target"]  # at its default, a later field leaves the identity alone

