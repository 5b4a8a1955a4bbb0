"""Latencies from token timestamps, percentiles, busy time, and the fidelity verdict's arithmetic."""
import pytest

from testbed.measure.fidelity import LinkUse, link_use, payload_share, verdict
from testbed.measure.metrics import busy_time, percentiles, token_latencies


def test_token_latencies_of_a_synthetic_timeline():
    # arrives at 10; first token at 10.5 (prefill), second at 11.25 (after the P->D transfer),
    # then one every 0.05 s
    times = [10.5, 11.25, 11.30, 11.35, 11.40]
    lat = token_latencies(10.0, times)
    assert lat["ttft"] == pytest.approx(0.5)
    assert lat["ttst"] == pytest.approx(1.25)
    assert lat["tpot"] == pytest.approx(0.05)


def test_short_requests_have_no_ttst_or_tpot():
    assert token_latencies(0.0, [1.0]) == {"ttft": 1.0, "ttst": None, "tpot": None}
    assert token_latencies(0.0, [1.0, 3.0])["tpot"] is None


def test_time_going_backwards_is_an_error():
    with pytest.raises(ValueError):
        token_latencies(0.0, [2.0, 1.0])
    with pytest.raises(ValueError):
        token_latencies(5.0, [4.0])


def test_percentiles_interpolate_like_numpy_and_scale():
    import numpy as np

    xs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    got = percentiles(xs + [None])
    for p in (50, 90, 99):
        assert got[f"p{p}"] == pytest.approx(float(np.percentile(xs, p)))
    assert percentiles(xs, scale=0.5)["p50"] == pytest.approx(float(np.percentile(xs, 50)) / 2)
    assert percentiles([None]) == {"p50": None, "p90": None, "p99": None}


def test_busy_time_is_the_union_of_intervals():
    assert busy_time([(0, 1), (0.5, 2), (3, 4), (3.5, 3.6), (5, 5)]) == pytest.approx(3.0)
    assert busy_time([]) == 0.0


def test_link_use_clips_to_the_run_and_judges_saturation():
    rate = 80e6  # bit/s: 10 MB/s of wire
    share = payload_share(9000)
    # busy 8 s of a 10 s run, 8 s x 10 MB/s x share bytes: exactly at its rate
    loads = [(-1.0, 1.0, int(1e7 * share)), (1.0, 8.0, int(7e7 * share))]
    u = link_use("p0/snic", rate, (0.0, 10.0), loads, 9000)
    assert u.busy_s == pytest.approx(8.0)
    assert u.should_saturate
    # the first load is clipped to the run but keeps its bytes (it ended inside): a slight overcount
    assert u.rate_share == pytest.approx((8e7 * share) / 8 / (1e7 * share), rel=1e-6)
    slow = LinkUse("d0/snic", rate, 10.0, 8.0, int(8 * 1e7 * share * 0.5), share)
    ok, reasons = verdict([], [], 0.5, [slow])
    assert not ok and "d0/snic was the bottleneck" in reasons[0] and "50%" in reasons[0]
    idle = LinkUse("d0/snic", rate, 10.0, 2.0, 1000, share)  # busy 20 %: not a bottleneck, not judged
    assert verdict([], [], 0.5, [idle]) == (True, [])


def test_cpu_saturation_is_unfaithful():
    ok, reasons = verdict([], [{"overran": False, "late_s": 0, "held_s": 0.1}], 0.91, [])
    assert not ok and "CPU busy 91%" in reasons[0]
    assert verdict([], [], 0.85, []) == (True, [])


def test_overran_steps_are_counted_in_the_reason():
    steps = [{"overran": True, "late_s": 0.02, "held_s": 0.1}, {"overran": False, "late_s": 0.0, "held_s": 0.1}]
    ok, reasons = verdict([], steps, 0.2, [])
    assert not ok and reasons == ["1 of 2 decode steps overran their emulated time (worst: 20.0 ms late on a 100.0 ms window)"]


def test_one_overrun_in_a_hundred_is_tolerated_and_said_more_is_unfaithful():
    from testbed.measure.fidelity import tolerated

    ok_pass = {"overran": False, "late_s": 0.001, "held_s": 0.1}
    slip = {"overran": True, "late_s": 0.02, "held_s": 0.1}
    lone = [slip] + [ok_pass] * 199  # one slip in 200: within the 1 % allowance
    assert verdict(lone, [], 0.4, [], jct_s=60.0) == (True, [])
    assert tolerated(lone, []) == ["1 of 200 prefill passes overran their emulated time (worst: 20.0 ms late on a "
                                   "100.0 ms window): within the allowance of 1%"]
    three = [slip] * 3 + [ok_pass] * 197  # 3 in 200: beyond int(0.01 * 200) = 2
    ok, reasons = verdict(three, [], 0.4, [], jct_s=60.0)
    assert not ok and reasons[0].startswith("3 of 200 prefill passes overran") and tolerated(three, []) == []
    assert not verdict([slip] + [ok_pass] * 98, [], 0.4, [])[0]  # 99 passes: no allowance at all


def test_tolerated_overruns_may_not_add_up_to_a_percent_of_the_jct():
    ok_pass = {"overran": False, "late_s": 0.009, "held_s": 0.1}  # jitter within the margin: never summed
    big = {"overran": True, "late_s": 0.8, "held_s": 0.1}
    runs = [big] + [ok_pass] * 199
    ok, reasons = verdict(runs, [], 0.4, [], jct_s=60.0)
    assert not ok and "overran were 800 ms late in all, 1.3% of the run's JCT" in reasons[0]
    assert verdict(runs, [], 0.4, [], jct_s=100.0) == (True, [])  # 0.8 % (the 1.8 s of jitter is not counted)


def test_the_chain_bound_is_the_longest_agents_reads_and_computes_in_sequence():
    from testbed.measure.metrics import chain_bound_s

    # agent 0: two turns of 100 B at 50 B/s (2 s each) + 1 s prefill + 1 s decode; agent 1: one short turn
    turns = {0: [(100, 1.0, 1.0), (100, 1.0, 1.0)], 1: [(0, 0.5, 0.5)]}
    assert chain_bound_s(turns, 50.0) == 8.0
    assert chain_bound_s({}, 50.0) is None and chain_bound_s(turns, 0.0) is None


def test_the_speedup_bound_is_the_least_of_its_three_and_says_which():
    from testbed.measure.metrics import speedups

    light = {"basic": {"jct_s": 10.0}, "dualpath": {"jct_s": 6.0}, "oracle": {"jct_s": 4.0}}
    speedups(light, 1, 2, chain_s=5.0)  # nodes 3, io_free 2.5, chain 2: the chain binds
    d = light["dualpath"]
    assert d["speedup_bound"] == 2.0 and d["speedup_bound_by"] == "chain"
    assert d["speedup_bounds"] == {"nodes": 3.0, "io_free": 2.5, "chain": 2.0}
    loaded = {"basic": {"jct_s": 10.0}, "dualpath": {"jct_s": 6.0}, "oracle": {"jct_s": 2.0}}
    speedups(loaded, 1, 1, chain_s=2.5)  # nodes 2 binds: reading on both nodes is the limit
    assert loaded["dualpath"]["speedup_bound"] == 2.0 and loaded["dualpath"]["speedup_bound_by"] == "nodes"
    bare = {"basic": {"jct_s": 10.0}, "dualpath": {"jct_s": 6.0}}
    speedups(bare, 2, 1)  # no oracle, no chain: the nodes' bound alone
    assert bare["dualpath"]["speedup_bounds"] == {"nodes": 1.5}


def test_another_server_busy_or_unread_makes_the_run_unfaithful():
    from testbed.measure.monitor import busy_share, busy_total

    # /proc/stat's cpu fields: user nice system idle iowait irq softirq steal
    before, after = busy_total([100, 0, 50, 800, 50, 0, 0, 0]), busy_total([1050, 0, 90, 820, 50, 0, 0, 0])
    assert busy_share(before, after) == pytest.approx(990 / 1010)
    ok, reasons = verdict([], [], 0.3, [], server_cpu={"guest": busy_share(before, after), "b": 0.4})
    assert not ok and len(reasons) == 1 and reasons[0].startswith("server guest: CPU busy 98% of its cores")
    ok, reasons = verdict([], [], 0.3, [], server_cpu={"b": None})
    assert not ok and "could not be read" in reasons[0]
    assert verdict([], [], 0.3, [], server_cpu={"b": 0.5}) == (True, [])


def test_other_servers_cpu_is_read_at_the_start_and_the_end():
    from testbed.measure.monitor import ServersCpu

    readings = {"b": iter([[100, 0, 50, 800, 50, 0, 0, 0], [1050, 0, 90, 820, 50, 0, 0, 0]]), "c": iter([None, None])}
    with ServersCpu({name: (lambda it=it: next(it)) for name, it in readings.items()}) as others:
        pass
    assert others.busy() == {"b": pytest.approx(0.98, abs=1e-3), "c": None}
