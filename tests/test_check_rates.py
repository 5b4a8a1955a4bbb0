"""The link calibration's rate from sampled HTB counters (pure; the live check is test_shaping)."""
import pytest

from testbed.calibrate.check import SAMPLE_S, TRIM_S, _backlogged_rate_bps, _steady_rate_bps


def _samples(rates_bps: list[float]) -> list[tuple[float, int]]:
    out, b = [(0.0, 0)], 0.0
    for i, r in enumerate(rates_bps, 1):
        b += r * SAMPLE_S / 8
        out.append((i * SAMPLE_S, int(b)))
    return out


def test_the_rate_leaves_out_set_up_slow_start_and_teardown():
    idle, ramp, steady = [0.0] * 6, [1e8, 3e8, 6e8], [1e9] * 40
    tail = [2e8, 1e3] + [0.0] * 6  # the flow winds down, then iperf3's results exchange
    samples = _samples(idle + ramp + steady + tail)
    assert _steady_rate_bps(samples) == pytest.approx(1e9, rel=0.01)
    # what the old whole-flow average gave: well below the link's rate
    moved = samples[-1][1] * 8 / ((len(ramp) + len(steady) + 2) * SAMPLE_S)
    assert moved < 0.95e9


def test_a_flow_too_short_to_trim_is_measured_whole_and_no_flow_is_zero():
    assert TRIM_S > 2 * SAMPLE_S
    assert _steady_rate_bps(_samples([0.0, 5e8, 5e8, 0.0])) == pytest.approx(5e8, rel=0.01)
    assert _steady_rate_bps(_samples([0.0] * 5)) == 0.0
    assert _steady_rate_bps([]) == 0.0


def test_a_tcp_stall_does_not_read_as_a_slow_shaper_but_a_slow_shaper_does():
    # A 2 s flow as the check runs it; a retransmission timeout idles the link 300 ms mid-flow.
    stalled = _samples([0.0] * 2 + [1e9] * 17 + [0.0] * 6 + [1e9] * 17 + [0.0] * 2)
    assert _backlogged_rate_bps(stalled) == pytest.approx(1e9, rel=0.01)
    assert _steady_rate_bps(stalled) < 0.85e9  # the mean the old check used failed here
    # a shaper at 0.7 of its rate reads as 0.7, stall or none
    slow = _samples([0.0] * 2 + [7e8] * 17 + [0.0] * 6 + [7e8] * 17 + [0.0] * 2)
    assert _backlogged_rate_bps(slow) == pytest.approx(7e8, rel=0.01)
    assert _backlogged_rate_bps(_samples([0.0, 5e8, 5e8, 0.0])) == pytest.approx(5e8, rel=0.01)
    assert _backlogged_rate_bps([]) == 0.0


def test_steal_share_is_the_hypervisors_jiffies_over_all():
    from testbed.measure.monitor import read_steal, steal_share

    assert steal_share((100, 1000), (150, 2000)) == pytest.approx(0.05)
    assert steal_share((5, 10), (5, 10)) == 0.0  # no time passed: no share, no division by zero
    steal, total = read_steal()
    assert 0 <= steal <= total


def test_a_busy_host_verdict_names_the_hypervisors_steal_and_the_monitor_measures_it():
    from testbed.measure.fidelity import CPU_BUSY_MAX, verdict
    from testbed.measure.monitor import Monitor, Sample

    ok, reasons = verdict([], [], CPU_BUSY_MAX + 0.05, [], cpu_own=0.4, cpu_steal=0.2)
    assert not ok and "the hypervisor's steal 20%" in reasons[0]
    assert "steal" not in verdict([], [], CPU_BUSY_MAX + 0.05, [], cpu_own=0.4)[1][0]
    mon = Monitor([])
    mon.samples = [Sample(0.0, 100, 1000, {}, 0, 50), Sample(1.0, 700, 2000, {}, 0, 300)]
    assert mon.cpu_steal() == pytest.approx(0.25)
