"""Reaching other servers (testbed/fabric/remote.py) without one: the SSH command line, the check
script's report, commits, and the tunnel devices' lines. The script itself runs on this machine
in tests/test_placement.py and against a QEMU guest in make cluster-test."""
import pytest
import subprocess

from testbed.fabric import remote
from testbed.placement import Tunnel
from testbed.topology_servers import ServerSpec


def test_ssh_line_never_prompts_and_ends_options_before_the_destination():
    v = ServerSpec(name="b", ssh="root@10.0.0.2", port=2222, identity_file="/k/id", known_hosts="/k/known")
    argv = remote.ssh_argv(v, "true")
    assert argv[0] == "ssh" and argv[-3:] == ["--", "root@10.0.0.2", "true"]
    joined = " ".join(argv)
    assert "BatchMode=yes" in joined and "-p 2222" in joined and "-i /k/id" in joined
    assert "UserKnownHostsFile=/k/known" in joined and "StrictHostKeyChecking=yes" in joined
    assert "ControlPath=/tmp/dpt-ssh-%C" in joined  # cleanup finds a master a killed run left
    plain = " ".join(remote.ssh_argv(ServerSpec(name="c", ssh="c.example"), "true"))
    assert "StrictHostKeyChecking=accept-new" in plain and "-p " not in plain


def test_this_machine_runs_without_ssh():
    p = remote.run_on(ServerSpec(name="a"), ["bash", "-c", "pwd; cat"], stdin="hello")
    assert p.returncode == 0 and p.stdout.split() == [str(remote.REPO), "hello"]


def _done(out: str, err: str = "", rc: int = 0) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess([], rc, out, err)


def test_script_lines_become_checks_and_silence_is_an_ssh_problem():
    got = remote._parse("b", _done("root\tok\tuid 0\nvxlan\tproblem\tcannot make one\nnoise\n"))
    assert [(c.name, c.ok) for c in got] == [("root", True), ("vxlan", False)]
    assert got[1].line() == "b: PROBLEM vxlan: cannot make one"
    (c,) = remote._parse("b", _done("", "ssh: connect to host 127.0.0.1 port 9: Connection refused", 255))
    assert c.name == "ssh" and not c.ok and "Connection refused" in c.detail


def test_another_commit_is_a_problem_and_no_git_is_not_judged():
    a, b = "a" * 40, "b" * 40
    same, other, nogit = (remote.Check("b", "checkout", True, x) for x in (a, b, "no .git"))
    assert remote._same_commit([same], a)[0].ok
    assert not remote._same_commit([other], a)[0].ok and "at commit bbbbbbbbbbbb" in remote._same_commit([other], a)[0].detail
    assert remote._same_commit([nogit], a)[0].ok


def test_tunnel_lines_name_the_kind_key_and_bridge():
    vx = Tunnel("vxlan", "compute", "a", "b", "dpt-vc0-1", 4450000)
    lines = remote.tunnel_lines(vx, "10.79.0.1", "10.79.0.2", "dpt-cbr", 8900)
    assert lines == ["link add dpt-vc0-1 type vxlan id 4450000 local 10.79.0.1 remote 10.79.0.2 dstport 4789",
                     "link set dev dpt-vc0-1 mtu 8900 master dpt-cbr up"]
    gre = Tunnel("gretap", "storage", "a", "b", "dpt-gs0-1", 4450001)
    assert remote.tunnel_lines(gre, "1.1.1.1", "2.2.2.2", "dpt-sbr", 1458)[0] == \
        "link add dpt-gs0-1 type gretap local 1.1.1.1 remote 2.2.2.2 key 4450001 ttl 64"


def test_another_clock_is_read_against_the_quickest_round_trip():
    # (sent, its reading, received): the second round trip is the quickest (2 ms)
    readings = [(10.0, 1010.5, 10.4), (11.0, 1011.001, 11.002), (12.0, 1012.9, 12.3)]
    offset, uncertainty = remote.best_offset(readings)
    assert offset == pytest.approx(1000.0) and uncertainty == pytest.approx(0.001)


def test_a_clock_read_through_an_open_shell_is_tight():
    from testbed.topology_servers import ServerSpec

    offset, uncertainty = remote.clock_offset(ServerSpec(name="here"))  # no ssh: this machine's own bash
    assert abs(offset) <= uncertainty + 1e-3 and 0 < uncertainty < 0.02


def test_every_control_server_tells_its_clock():
    import time

    from dualpath.control import RpcServer

    srv = RpcServer("inproc://dpt-clock-test", {})
    try:
        before = time.monotonic()
        import msgpack

        rep = srv.handle(msgpack.packb({"cmd": "clock"}))
        assert rep["ok"] and before <= rep["monotonic"] <= time.monotonic()
    finally:
        srv.sock.close()
        srv.ctx.term()
