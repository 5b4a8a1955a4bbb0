"""`dualpath bench transport --transport mooncake`: Mooncake's transfer engine across two engine
namespaces, byte-exact, its bytes in the kv class, its READ and WRITE measured beside iperf3 on the
same shaped link (the figures are the benchmark's; here only that they exist and are sane), and a
missing wheel is one line naming what to install."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, dualpath, needs_root


@pytest.fixture(autouse=True, scope="module")
def _own_the_machine():
    """This module's tests bring up a testbed: skip them while another run holds one."""
    from tests.conftest import own_the_machine
    own_the_machine()


try:
    from testbed.calibrate.benches.transport_mooncake import need_mooncake

    need_mooncake()
    HAVE = True
except Exception:
    HAVE = False


@needs_root
@pytest.mark.skipif(not HAVE, reason="the Mooncake wheel is not installed (scripts/bootstrap.sh installs it)")
def test_mooncake_moves_bytes_exactly_in_the_kv_class(tmp_path):
    r = dualpath("bench", "transport", "topologies/1p1d.yaml", "--transport", "mooncake", "--out", str(tmp_path),
                 timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (run,) = (tmp_path / "transport").iterdir()
    s = json.loads((run / "summary.json").read_text())
    assert s["byte_exact"] and s["in_kv_class"], s["class_bytes_sent"]
    for op in ("READ", "WRITE"):
        assert 0.3 < s["shaped"][f"{op}_over_iperf3_median"] < 1.5, s["shaped"]
    assert "READ" in (run / "report.md").read_text()


def test_a_missing_wheel_is_one_line(tmp_path):
    # a module named mooncake that is not a package: what an interpreter without the wheel finds
    (tmp_path / "mooncake.py").write_text("")
    code = ("from testbed.calibrate.benches.transport_mooncake import need_mooncake, MissingMooncake\n"
            "try:\n    need_mooncake()\nexcept MissingMooncake as e:\n    print(e)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    assert p.stdout.count("\n") == 1 and "pip install --no-deps mooncake-transfer-engine-non-cuda" in p.stdout, p
