"""`dualpath reproduce isolation`'s analysis on a hand-built run folder with known answers (no root)."""
import json

import pytest

from testbed.reproduce import reproduce_id
from testbed.reproduce import isolation as iso
from tests.reproduce_helpers import RunFolder, is_valid_png, plan_json

K = 20.0


def _logs(n: int, s: float, tokens: int, jitter: float = 0.0) -> list[dict]:
    return [{"t": i * 0.1, "s": s * (1 + jitter * (i % 10) / 10), "tokens": tokens, "sent": 1000 * tokens,
             "received": 2000 * tokens} for i in range(n)]


def _build(tmp_path, slow_off: float = 5.0, on: float = 1.02, kv_on: float = 0.97, faithful: bool = True,
           tokens: dict | None = None):
    """`tokens`: a condition's prefill collectives' size (default 100 tokens in every condition)."""
    cfg = iso.config(True)
    f = RunFolder(tmp_path / "run", dilation=K, topology=iso.TOPOLOGY)
    factor = {"idle": 1.0, "qos_on": on, "qos_off": slow_off}
    for cond in iso.CONDITIONS:
        x = factor[cond]
        passes = [{"pe": f"p{j % 2}", "t_start": 10.0 * j, "t_end": 10.0 * j + 8 * (0.1 + 0.01 * x),
                   "timing": {"collective_log": _logs(8, 0.01 * x * (tokens or {}).get(cond, 100) / 100,
                                                      (tokens or {}).get(cond, 100), 0.1)}} for j in range(30)]
        steps = [{"de": f"d{j % 2}", "t_start": 5.0 * j, "t_end": 5.0 * j + 0.5 + 8 * 0.001 * x,
                  "collective_log": _logs(8, 0.001 * x, 8, 0.1)} for j in range(30)]
        records = [{"request": f"r{i}", "ttft_s": 1.0 * (0.5 + 0.5 * x), "tpot_s": 0.03 * (0.6 + 0.4 * x)}
                   for i in range(20)]
        f.mode(cond, faithful=faithful or cond != "qos_off", passes=passes, records=records,
               links=[{"t": t, "cpu_busy": 0.5, "nics": {"dpt-p0e0/cnic": [t * 1.2e8, 0]}} for t in range(10)])
        f.rows["steps"] += [{"mode": cond, **s} for s in steps]
        m = f.summary["modes"][cond]
        m["ttft_s"] = {"p50": 0.5 + 0.5 * x, "p90": 0.6 + 0.5 * x, "p99": 0.7 + 0.5 * x}
        m["tpot_s"] = {"p50": 0.03 * (0.6 + 0.4 * x), "p90": 0.03, "p99": 0.031 * (0.6 + 0.4 * x)}
        m["collectives"] = {"sent_bytes": 240 * 100_000, "received_bytes": 240 * 200_000}
        m["isolation"] = {"qos": cond != "qos_off", "kv_load": cond != "idle",
                          "kv_bytes_per_s": None if cond == "idle" else 1.2e8 * (kv_on if cond == "qos_on" else 1.0),
                          "class_bytes": {"model": 74_000_000, "kv": 0 if cond == "idle" else 9_000_000_000},
                          "cnic_rx_share_of_rate": {"dpt-p0e0": 0.97}}
    f.write(plan=plan_json(cfg))
    return f.path, cfg


def test_the_summary_has_the_interface_the_checks_read(tmp_path):
    run, _ = _build(tmp_path)
    out, res = reproduce_id("isolation", quick=True, out_root=tmp_path / "out", run_folders=[run],
                            progress=lambda _m: None, run_id="x")
    s = json.loads((out / "summary.json").read_text())
    assert s["faithful"] is True and s["complete"] is True
    p99 = s["collective_p99_s"]
    assert set(p99) == {"idle", "qos_on", "qos_off"}
    # the tail is the prefill collectives', 0.01 .. 0.0107 testbed s; emulated: / K
    assert p99["idle"] == pytest.approx(0.0107 / K, rel=1e-3)
    assert s["p99_over_idle"]["qos_on"] == pytest.approx(1.02, rel=1e-3)
    assert s["p99_over_idle"]["qos_off"] == pytest.approx(5.0, rel=1e-3)
    assert s["kv_throughput_on_over_off"] == pytest.approx(0.97)
    assert s["model_class_bytes"] == {"idle": 74_000_000, "qos_on": 74_000_000, "qos_off": 74_000_000}
    assert s["kv_class_bytes"]["qos_off"] == 9_000_000_000 and s["kv_class_bytes"]["idle"] == 0
    chk = s["checks"]
    assert chk["collective_p99"]["qos_on_ok"] and chk["collective_p99"]["qos_off_ok"] and chk["kv_throughput"]["ok"]
    assert chk["ttft_s_p99"]["qos_off_over_idle"] == pytest.approx((0.7 + 2.5) / 1.2)
    for p in s["pngs"]:
        assert is_valid_png(out / p), p
    assert len(s["pngs"]) == 7
    report = (out / "report.md").read_text()
    assert "MET: QoS on keeps collective p99 within 1.1x idle" in report and "| KV load, QoS off |" in report


def test_a_shortfall_is_reported_not_hidden(tmp_path):
    run, _ = _build(tmp_path, slow_off=1.5, on=1.3, kv_on=0.8, faithful=False)
    out, res = reproduce_id("isolation", quick=True, out_root=tmp_path / "out", run_folders=[run],
                            progress=lambda _m: None, run_id="x")
    s = json.loads((out / "summary.json").read_text())
    assert s["faithful"] is False
    chk = s["checks"]
    assert not chk["collective_p99"]["qos_on_ok"] and not chk["collective_p99"]["qos_off_ok"]
    assert not chk["kv_throughput"]["ok"] and not chk["all_faithful"]
    report = (out / "report.md").read_text()
    assert "NOT MET: QoS on keeps collective p99 within 1.1x idle" in report and "NOT FAITHFUL" in report


def test_matched_collectives_keeps_the_sizes_every_condition_ran_as_often_as_the_fewest():
    def row(role, tokens, t, s=0.01):
        return {"role": role, "tokens": tokens, "t": t, "s": s}

    rows = {"idle": [row("prefill", 100, 3), row("prefill", 100, 1), row("decode", 8, 0), row("prefill", 512, 2)],
            "qos_on": [row("prefill", 100, 5), row("decode", 8, 1), row("decode", 8, 2), row("prefill", 187, 0)]}
    m = iso.matched_collectives(rows)
    assert [(r["role"], r["tokens"], r["t"]) for r in m["idle"]] == [("decode", 8, 0), ("prefill", 100, 1)]
    assert [(r["role"], r["tokens"], r["t"]) for r in m["qos_on"]] == [("decode", 8, 1), ("prefill", 100, 5)]


def test_the_pooled_collectives_decide_and_the_same_sizes_are_the_second_row(tmp_path):
    # QoS on batched bigger (200 tokens: twice the bytes, twice the time) at the same speed per
    # byte: the pooled p99, what a user sees, doubles and decides; the same-size comparison, the
    # second row, sees what the links did (x1.02)
    run, _ = _build(tmp_path, tokens={"qos_on": 200})
    out, _ = reproduce_id("isolation", quick=True, out_root=tmp_path / "out", run_folders=[run],
                          progress=lambda _m: None, run_id="x")
    s = json.loads((out / "summary.json").read_text())
    assert s["p99_over_idle"]["qos_on"] == pytest.approx(2.04, rel=1e-3)
    assert s["p99_over_idle_matched"]["qos_on"] == pytest.approx(1.02, rel=1e-3)  # the decode collectives
    on = s["conditions"]["qos_on"]
    assert on["collective"]["n"] == 480 and on["collective_matched"]["n"] == 240
    assert not s["checks"]["collective_p99"]["qos_on_ok"]
    names = [h["name"] for h in s["headline"]]
    assert names.index("collective p99 with QoS on / idle (x, all collectives; issue: <= 1.1)") < \
        names.index("collective p99 with QoS on / idle (x, the sizes all conditions ran)")
    report = (out / "report.md").read_text()
    assert "The verdicts are over every collective of each condition (pooled)" in report
    assert "bfifo of 16 MiB" in report and "the most a FIFO behind the kv load can add" in report


def test_a_latency_still_climbing_is_not_a_steady_state_and_a_filled_queue_is():
    def rows(values):
        return [{"t": float(i), "s": v} for i, v in enumerate(values)]

    flat = iso.trend(rows([0.01] * 60), k=2.0)
    assert flat["steady"] is True and flat["settled_at_s"] == 0 and flat["p50_by_third"] == [0.005] * 3
    climbing = iso.trend(rows([0.001 * (1 + i) for i in range(60)]), k=1.0)
    assert climbing["steady"] is False and climbing["settled_at_s"] > 40 and not climbing["flat"]
    # a FIFO filling: the latency climbs for 20 collectives, then holds at the queue's depth
    filled = iso.trend(rows([0.0005 * (1 + i) for i in range(20)] + [0.01] * 60), k=1.0)
    assert filled["steady"] is True and filled["final_s"] == 0.01 and 15 <= filled["settled_at_s"] <= 24
    # two kinds of collective interleaved (decode's small, prefill's large): noisy, but flat
    mixed = iso.trend(rows([0.001 if i % 3 else 0.05 for i in range(90)]), k=1.0)
    assert mixed["flat"] is True and mixed["steady"] is True
    assert iso.trend(rows([0.01] * 20), k=1.0)["steady"] is None  # too few to say


def test_every_ratio_headline_has_its_interval_over_its_own_units(tmp_path):
    run, _ = _build(tmp_path, kv_on=0.95)
    out, res = reproduce_id("isolation", quick=True, out_root=tmp_path / "out", run_folders=[run],
                            progress=lambda _m: None, run_id="x")
    heads = {h["name"]: h for h in json.loads((out / "summary.json").read_text())["headline"]}
    for name, h in heads.items():
        assert h["ci95"] is not None and h["n"], name
        assert h["ci95"][0] <= h["testbed"] <= h["ci95"][1], name
    # TTFT and TPOT: the p99 of each condition's own requests (20 each), 1 + 0.5 (x - 1) times idle's
    ttft = heads["TTFT p99 with QoS off / idle (x)"]
    assert ttft["testbed"] == pytest.approx(3.0) and ttft["n"] == 20 and "requests" in ttft["ci_method"]
    # kv: the class counters' ratio, its interval from the CNIC's sample windows (9 per condition)
    kv = heads["kv load throughput, QoS on / off (x; issue: >= 0.9)"]
    assert kv["testbed"] == pytest.approx(0.95) and kv["n"] == 9 and "sample windows" in kv["ci_method"]


def test_the_kv_interval_widens_with_the_spread_of_the_windows(tmp_path):
    from testbed.measure.runs import load_run
    run, _ = _build(tmp_path)
    r = load_run(run)
    assert iso.cnic_rx_rates(r, "qos_on") == pytest.approx([1.2e8] * 9)
    steady = iso.kv_ratio_draws(r, 0.97).estimate()
    assert steady.ci95 == pytest.approx((0.97, 0.97))
    # uneven windows: the same total rate, an interval around the counters' ratio
    for s in r.links("qos_on"):
        s["nics"]["dpt-p0e0/cnic"][0] = s["t"] * 1.2e8 + (3e7 if int(s["t"]) % 2 else 0)
    lo, hi = iso.kv_ratio_draws(r, 0.97).estimate().ci95
    assert lo < 0.97 < hi and hi - lo > 0.05


@pytest.mark.parametrize("quick", [True, False])
def test_the_plan_estimates_each_condition_within_25_percent_of_the_committed_run(quick):
    """QoS off takes about 3x idle here (its collectives wait behind the KV load's FIFO): the
    estimate must say so, not price the three conditions alike. It takes the longer run's
    slowdown, so the shorter run's QoS off is overestimated (by 20 %)."""
    from testbed.reproduce.plan import MODE_OVERHEAD_S, estimate
    from tests.conftest import REPO

    cfg = iso.config(quick)
    runs = REPO / "results" / "reproduce" / "isolation" / "runs"
    (run,) = [p for p in runs.iterdir() if p.name.endswith(cfg.digest())]
    measured = {m: v["jct_testbed_s"] for m, v in json.loads((run / "summary.json").read_text())["modes"].items()}
    est = estimate(cfg)["per_mode_s"]
    for m in iso.CONDITIONS:
        assert est[m] - MODE_OVERHEAD_S == pytest.approx(measured[m], rel=0.25), m
    assert est["qos_off"] > 2.5 * est["idle"]
