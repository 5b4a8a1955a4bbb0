"""Timeouts scale on a slow machine (the Soft-RoCE VM under QEMU TCG), and only there."""
import subprocess
import sys

import pytest

from dualpath import timeouts
from tests.conftest import REPO


def test_the_scale_is_one_on_a_host_and_larger_in_the_vm(monkeypatch):
    monkeypatch.delenv("DPT_TIMEOUT_SCALE", raising=False)
    monkeypatch.delenv("DPT_IN_VM", raising=False)
    assert timeouts.timeout_scale() == 1.0 and timeouts.scaled(120.0) == 120.0
    monkeypatch.setenv("DPT_IN_VM", "1")
    assert timeouts.scaled(120.0) == 120.0 * timeouts.VM_FACTOR > 120.0
    monkeypatch.setenv("DPT_TIMEOUT_SCALE", "3")
    assert timeouts.scaled(10.0) == 30.0  # set by hand: wins over the VM's


@pytest.mark.parametrize("bad", ["x", "0", "-2", "5000"])
def test_a_bad_scale_is_a_clear_error(monkeypatch, bad):
    monkeypatch.setenv("DPT_TIMEOUT_SCALE", bad)
    with pytest.raises(ValueError, match="DPT_TIMEOUT_SCALE"):
        timeouts.timeout_scale()


def test_the_processes_defaults_follow_the_scale():
    # read in a fresh interpreter: the defaults are fixed when the modules are imported
    code = ("from dualpath.control import CALL_TIMEOUT_S; from dualpath.nodes.leader import STATE_TIMEOUT_S; "
            "from dualpath.transport.agent import DEFAULT_TIMEOUT_S; print(CALL_TIMEOUT_S, STATE_TIMEOUT_S, DEFAULT_TIMEOUT_S)")
    env = {"PATH": "/usr/bin:/bin", "DPT_TIMEOUT_SCALE": "4"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert [float(x) for x in out.stdout.split()] == [480.0, 12.0, 240.0]
