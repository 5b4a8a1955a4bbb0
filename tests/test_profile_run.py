"""`dualpath profile run`: a real run under py-spy, its CPU by role and while the modes ran, and the
floor beside it; bad arguments are one line each. The numbers are the profile's; here only that
they exist, add up and are sane."""
from __future__ import annotations

import json

import pytest

from tests.conftest import dualpath, needs_root


@pytest.fixture(autouse=True, scope="module")
def _own_the_machine():
    """This module's tests bring up a testbed: skip them while another run holds one."""
    from tests.conftest import own_the_machine
    own_the_machine()


@needs_root
def test_a_profiled_run_says_where_its_cpu_went(tmp_path):
    p = dualpath("profile", "run", "topologies/1p1d-io.yaml", "--modes", "dualpath", "--trajectories", "4",
                 "--seed", "1", "--out", str(tmp_path), "--iperf-s", "1", timeout=400)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (run,) = (tmp_path / "run").iterdir()
    s = json.loads((run / "summary.json").read_text())
    assert s["cpu_s_per_emulated_s"] > 0 and s["emulated_s"] > 0 and s["modes"] == ["dualpath"]
    assert s["cpu_s_per_emulated_s"] == pytest.approx(s["cpu_s"] / s["emulated_s"], rel=0.01)
    for role in ("prefill engines", "decode engines", "host agents", "store", "cli and conductor", "kernel"):
        assert s["by_role"][role] > 0, role
    assert sum(s["by_role"].values()) == pytest.approx(s["cpu_s"], abs=0.1)
    # the modes' own window is part of the whole command
    im = s["in_modes"]
    assert 0 < im["cpu_s"] < s["cpu_s"] and im["emulated_s"] == pytest.approx(s["emulated_s"], rel=1e-3)
    assert s["samples"] > 0 and s["profiler"]["py_spy_cpu_s"] > 0
    fl = s["floor"]
    assert fl["model_cpu_s"] > 0 and fl["tokens"]["prefilled"] > 0 and fl["kernel_cpu_s_per_gb"] > 0
    assert s["over_floor"] > 1  # the run costs more than its tokens and bytes alone
    assert (run / "cpu.png").stat().st_size > 2000 and "CPU s per emulated s" in (run / "report.md").read_text()
    assert "run costs" in p.stdout and "while the modes ran" in p.stdout


@pytest.mark.parametrize("args, msg", [
    (["topologies/nope.yaml"], "nope.yaml"),
    (["topologies/1p1d-io.yaml", "--checkout", "/tmp"], "not a checkout of the testbed"),
    (["topologies/1p1d-io.yaml", "--rate", "0"], "--rate"),
])
def test_bad_arguments_are_one_line(args, msg):
    p = dualpath("profile", "run", *args, timeout=60)
    assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_the_cost_model_fit_moved_under_profile_model():
    p = dualpath("profile", "model", "--help")
    assert p.returncode == 0 and "cost model" in p.stdout
