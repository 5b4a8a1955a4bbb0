"""The Python API through the project's own pytest fixture (testbed/pytest_plugin.py): one 1p1d
fabric for the module, which the CLI sees too."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from testbed.api import TestbedError
from tests.conftest import dualpath, needs_root


@pytest.fixture(autouse=True, scope="module")
def _own_the_machine():
    """This module's tests bring up a testbed: skip them while another run holds one."""
    from tests.conftest import own_the_machine
    own_the_machine()


pytestmark = [needs_root, pytest.mark.dualpath_topology("1p1d")]


def test_exec_runs_in_the_node_namespace(dualpath_testbed):
    tb = dualpath_testbed
    links = tb.exec("p0e0", ["ip", "-br", "link"], check=True).stdout
    assert {l.split()[0].split("@")[0] for l in links.splitlines()} == {"lo", "dpt-p0e0-cnic"}
    out = tb.exec("d0e0", 'echo "$DUALPATH_NODE $DUALPATH_IFACE $DUALPATH_IP"', check=True).stdout.split()
    assert out == ["dpt-d0e0", "dpt-d0e0-cnic", tb.address("d0e0")]
    assert tb.exec("d0", "exit 3").returncode == 3
    with pytest.raises(TestbedError, match=r"^p0e0: exit 4 exited with 4"):
        tb.exec("p0e0", "exit 4", check=True)
    with pytest.raises(TestbedError, match=r"^no node 'q7'.*nodes: p0, p0e0"):
        tb.exec("q7", ["true"])
    env = tb.env("p0e0", ucx=True)
    assert env["UCX_TLS"] == "tcp" and env["UCX_NET_DEVICES"] == "dpt-p0e0-cnic"


CONNECT = "import socket, sys; s = socket.create_connection((sys.argv[1], int(sys.argv[2])), 5); s.sendall(b'hi')"
ACCEPT = ("import socket, sys; l = socket.create_server((sys.argv[1], 0)); print(l.getsockname()[1], flush=True); "
          "l.settimeout(10); c, _ = l.accept(); print(c.recv(2).decode(), flush=True)")


def _reach(tb, client: str, server: str | None, ip: str) -> None:
    """A TCP connection from `client`'s namespace to `ip` (in `server`'s, or this process's)."""
    if server is None:
        with socket.create_server((ip, 0)) as lsock:
            lsock.settimeout(10)
            tb.exec(client, [sys.executable, "-c", CONNECT, ip, str(lsock.getsockname()[1])], check=True)
            conn, _ = lsock.accept()
            assert conn.recv(2) == b"hi"
            conn.close()
        return
    srv = tb.popen(server, [sys.executable, "-c", ACCEPT, ip], stdout=subprocess.PIPE, text=True)
    try:
        port = srv.stdout.readline().strip()
        tb.exec(client, [sys.executable, "-c", CONNECT, ip, port], check=True)
        assert srv.stdout.readline().strip() == "hi"
    finally:
        srv.kill()
        srv.wait()


def test_addresses_reach_across_the_fabric(dualpath_testbed):
    tb = dualpath_testbed
    assert tb.addresses["dpt-p0"] == {"host_port": "10.77.0.1", "snic": "10.78.0.1"}
    assert tb.address("p0", "snic") == "10.78.0.1"
    assert tb.engines == ["dpt-p0e0", "dpt-p0e1", "dpt-d0e0", "dpt-d0e1"]
    # CNIC to CNIC, and a storage server to this process's address on the storage network
    _reach(tb, "p0e0", "d0e0", tb.address("d0e0"))
    _reach(tb, "s0", None, tb.state["root_addresses"]["storage"])
    with pytest.raises(TestbedError, match="no store: bring it up with services=True"):
        tb.store


def test_the_cli_sees_it_and_refuses_a_second(dualpath_testbed):
    st = json.loads(dualpath("status", "--json").stdout)
    assert st["status"] == "up" and st["owner"]["kind"] == "api" and st["topology"]["name"] == "1p1d"
    r = dualpath("exec", "p0e1", "--", "cat", "/proc/self/net/dev")
    assert r.returncode == 0 and "dpt-p0e1-cnic" in r.stdout
    r = dualpath("up", "--detach")
    assert r.returncode == 1 and "already up, owned by pid" in r.stderr and len(r.stderr.splitlines()) == 1
    r = dualpath("down")  # not a detached runner's: it belongs to this process
    assert r.returncode == 1 and "--force" in r.stderr
    assert dualpath_testbed.exec("p0e0", ["true"]).returncode == 0  # still up
