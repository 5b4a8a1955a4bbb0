"""A multi-turn trace of known structure replayed by `dualpath run` on 1p1d-io: its sessions and
chained turns as built, the run's hit rate the trace's, bit-exact and FAITHFUL in Basic and
DualPath, every NIC's bytes within 2 %."""
from __future__ import annotations

import json

import pytest

from tests.conftest import dualpath, needs_root
from tests.test_trace import direct_count, known_trace, write


@pytest.fixture(autouse=True, scope="module")
def _own_the_machine():
    """This module's tests bring up a testbed: skip them while another run holds one."""
    from tests.conftest import own_the_machine
    own_the_machine()


pytestmark = needs_root


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    d = tmp_path_factory.mktemp("trace")
    rows, _ = known_trace(n_sessions=3, n_turns=3)
    trace = write(d / "known.jsonl", rows)
    r = dualpath("run", "topologies/1p1d-io.yaml", "--trace", str(trace), "--length-scale", "16",
                 "--time-scale", "4", "--modes", "basic,dualpath", "--out", str(d / "out"), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "3 sessions (6 chained turns" in r.stdout
    (run,) = (d / "out").iterdir()
    return json.loads((run / "summary.json").read_text()), rows


def test_sessions_and_hits_are_the_traces(summary):
    s, rows = summary
    t = s["trace"]
    assert (t["requests"], t["sessions"], t["chained_turns"]) == (9, 3, 6)
    assert t["trace_block_hit_rate"] == pytest.approx(direct_count(rows), abs=1e-6)
    for mode in ("basic", "dualpath"):
        assert abs(t["run_hit_rate_by_mode"][mode] - t["trace_block_hit_rate"]) <= 0.01, t


def test_replay_is_bit_exact_faithful_and_accounted(summary):
    s, _ = summary
    for mode in ("basic", "dualpath"):
        m = s["modes"][mode]
        assert m["faithful"], (mode, m["unfaithful_reasons"])
        assert m["errors"] == 0 and m["verification"]["all_match"], m["verification"]
        acc = m["kv_bytes_vs_expected"]
        assert acc["within"] == acc["nics"], acc["per_nic"]
