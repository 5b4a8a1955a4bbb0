"""`dualpath check` takes a priority measurement again when the host's CPU was saturated while
it ran (it measured the CPU, not the link), at most PRIORITY_TRIES times; no root needed: the
measurements are stand-ins, the retry logic is real."""
from __future__ import annotations

from types import SimpleNamespace

from testbed import check as chk
from testbed.monitor import CPU_SATURATED


class _Mon:
    def __init__(self, devs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def cpu_busy(self, *a):
        return 0.5


def _run(monkeypatch, busy: dict[bool, list[float]]):
    taken: dict[bool, int] = {True: 0, False: 0}

    def priority(fab, mon, qos, seconds):
        i = taken[qos]
        taken[qos] += 1
        r = chk.PriorityResult(qos, "dev", 100, 99.0 if qos else 50.0, 0.0, 1e9, 1, 1, busy[qos][i])
        r.kept_ratio = r.model_kept_bps / r.model_offered_bps
        return r

    monkeypatch.setattr(chk, "Monitor", _Mon)
    monkeypatch.setattr(chk, "link_cases", lambda fab: [])
    monkeypatch.setattr(chk, "_marking", lambda fab, s: {"kv_range_port": {"kv_class_share": 1.0}})
    monkeypatch.setattr(chk, "_priority", priority)
    fab = SimpleNamespace(nics=[], topo=SimpleNamespace(name="t", spec=SimpleNamespace(qos=True)),
                          apply_shaping=lambda qos: None)
    return chk.check(fab, seconds=0.1, progress=lambda m: None), taken


def test_a_measurement_on_a_saturated_cpu_is_taken_again(monkeypatch):
    rep, taken = _run(monkeypatch, {True: [CPU_SATURATED + 0.03, 0.4], False: [0.5]})
    on, off = rep.priority
    assert taken == {True: 2, False: 1}
    assert on.attempts == 2 and on.cpu_busy == 0.4 and off.attempts == 1


def test_retries_are_bounded_and_the_last_measurement_is_kept(monkeypatch):
    rep, taken = _run(monkeypatch, {True: [0.99] * 5, False: [0.5]})
    assert taken[True] == chk.PRIORITY_TRIES and rep.priority[0].attempts == chk.PRIORITY_TRIES
    assert rep.priority[0].cpu_busy == 0.99
