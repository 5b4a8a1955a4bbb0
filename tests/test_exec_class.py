"""A user's program in the class it asks for (`dualpath exec NODE --class kv|model`, or
`Testbed.exec(..., traffic_class=)`): its bytes are counted in that HTB class on its CNIC, whatever
its ports. The kv run uses a port outside the kv range and the model run one inside it, so only
the class asked for can explain where the bytes land."""
from __future__ import annotations

import sys

import pytest

from dualpath.traffic_classes import KV_PORT_RANGE

from testbed.api import TestbedError
from tests.conftest import dualpath, needs_root


@pytest.fixture(autouse=True, scope="module")
def _own_the_machine():
    """This module's tests bring up a testbed: skip them while another run holds one."""
    from tests.conftest import own_the_machine
    own_the_machine()


pytestmark = [needs_root, pytest.mark.dualpath_topology("1p1d")]

N = 4 << 20  # bytes the sender sends
RECEIVER = ("import socket, sys\n"
            "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            "s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(1); c, _ = s.accept(); n = 0\n"
            "while (b := c.recv(1 << 16)): n += len(b)\n"
            "print(n)\n")
SENDER = ("import socket, sys, time\n"
          "for _ in range(100):\n"
          "    try:\n"
          "        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10); break\n"
          "    except OSError: time.sleep(0.05)\n"
          f"c.sendall(b'x' * {N}); c.close()\n")


def send(tb, traffic_class: str | None, port: int) -> dict[str, int]:
    """Bytes p0e0's CNIC sent per class while the sender ran in `traffic_class`."""
    rx = tb.popen("d0e0", [sys.executable, "-c", RECEIVER, str(port)], stdout=-1, text=True)
    before = tb.class_bytes("p0e0", "cnic")["tx"]
    try:
        tb.exec("p0e0", [sys.executable, "-c", SENDER, tb.address("d0e0"), str(port)], check=True, timeout=60,
                traffic_class=traffic_class)
        assert int(rx.communicate(timeout=30)[0]) == N
    finally:
        rx.kill()
    after = tb.class_bytes("p0e0", "cnic")["tx"]
    return {c: after[c] - before[c] for c in after}


@pytest.mark.parametrize("cls, port", [("kv", 5301), ("model", KV_PORT_RANGE[0] + 500)])
def test_a_program_lands_in_the_class_it_asked_for(dualpath_testbed, cls, port):
    other = "model" if cls == "kv" else "kv"
    got = send(dualpath_testbed, cls, port)
    assert got[cls] >= N, got
    assert got[other] < N // 50, got  # the other class saw at most a few control packets


def test_without_a_class_the_ports_decide(dualpath_testbed):
    """The control: the same program with no class lands by port (the kv range is kv, others
    model), so the test above would fail if --class did nothing."""
    assert send(dualpath_testbed, None, KV_PORT_RANGE[0] + 501)["kv"] >= N
    assert send(dualpath_testbed, None, 5302)["model"] >= N


def test_exec_class_from_the_cli(dualpath_testbed):
    r = dualpath("exec", "p0e0", "--class", "model", "--python", "--", "-c",
                 "import os, sys; print(os.getgid(), os.environ['DUALPATH_CLASS'], sys.prefix)")
    assert r.returncode == 0, r.stderr
    gid, cls, prefix = r.stdout.split()
    from dualpath.traffic_classes import CLASS_GIDS

    assert (int(gid), cls, prefix) == (CLASS_GIDS["model"], "model", sys.prefix)
    bad = dualpath("exec", "p0e0", "--class", "gold", "--", "true")
    assert bad.returncode == 2 and bad.stderr.strip() == "dualpath: exec: --class 'gold': choose kv or model"
    with pytest.raises(TestbedError, match="no traffic class 'gold'"):
        dualpath_testbed.exec("p0e0", ["true"], traffic_class="gold")
