"""`dualpath bench ucx-perftest`: UCX's own benchmark across the fabric in each class. Parsing and
the class verdict without root; the bench itself on a live 1p1d with root (its bytes must land
in the class each leg asked for; the ratio to iperf3 is the bench's figure, not a test's)."""
from __future__ import annotations

import json

import pytest

from testbed.calibrate.benches.ucx_perftest import MB, in_class, parse_final
from tests.conftest import dualpath, is_root

FINAL = """+--------------+--------------+------------------------------+---------------------+-----------------------+
|    Stage     | # iterations | 50.0%ile | average | overall |  average |  overall |  average  |  overall  |
Final:                   100     0.000  8934.417  8934.417      111.93     111.93         112         112
"""


def test_final_line_is_bandwidth_in_bytes_per_second():
    assert parse_final(FINAL) == pytest.approx(111.93 * MB)
    only = "|  Stage | # iterations |\n+----+\n     357   9004.118 11182.132  8457.603   89.43   118.24   89   118\n"
    assert parse_final(only) == pytest.approx(118.24 * MB)  # -f: no label
    # ucp_get's row as printed in a CI run: its average latency read inf
    got = "+----+\n                         357   8470.471       inf  8485.922        0.00     117.84           0         118\n"
    assert parse_final(got) == pytest.approx(117.84 * MB)
    with pytest.raises(RuntimeError, match="no final row"):
        parse_final("ucx_perftest: error\n")


@pytest.mark.parametrize("moved, ok", [({"kv": 1100, "model": 10}, True), ({"kv": 900, "model": 10}, False),
                                       ({"kv": 1100, "model": 300}, False)])
def test_in_class_needs_the_payload_there_and_little_elsewhere(moved, ok):
    assert in_class({"class": "kv", "payload_bytes": 1000, "class_bytes": moved}) is ok


@pytest.mark.skipif(not is_root(), reason="needs root (namespaces, tc)")
def test_bench_puts_every_leg_in_its_class(tmp_path, no_leftovers):
    r = dualpath("bench", "ucx-perftest", "--out", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (run,) = (tmp_path / "ucx-perftest").iterdir()
    s = json.loads((run / "summary.json").read_text())
    assert s["all_in_class"], json.dumps(s["classes"], indent=1)[:3000]
    assert set(s["classes"]) == {"kv", "model"} and all(len(c["tests"]) == 3 for c in s["classes"].values())
