"""Bring-up builds what DESIGN.md section 2 says, and teardown leaves nothing, however it ends."""
import os
import signal
import subprocess

from pathlib import Path

import pytest

from dualpath.naming import PREFIX
from emulators.nic import parse_class_stats
from testbed.fabric.cleanup import find_leftovers
from testbed.fabric.network import Fabric, FabricBusy
from testbed.fabric.shell import run
from testbed.topology import load_topology
from tests.conftest import CLI, REPO, dualpath, needs_root

pytestmark = needs_root
TOPO = REPO / "topologies" / "1p1d.yaml"


def _ifaces(ns: str) -> set[str]:
    return {line.split()[0].split("@")[0] for line in run(["ip", "-br", "link"], ns=ns).splitlines()}


def _htb_rate_bits(dev: str, ns: str | None, classid: str) -> int:
    out = run(["tc", "class", "show", "dev", dev], ns=ns)
    for line in out.splitlines():
        if line.startswith(f"class htb {classid} "):
            word = line.split(" ceil ")[1].split()[0]
            units = {"Gbit": 10**9, "Mbit": 10**6, "Kbit": 10**3, "bit": 1}
            for u, mult in units.items():
                if word.endswith(u):
                    return int(float(word[: -len(u)]) * mult)
    raise AssertionError(f"no class {classid} on {dev}")


def test_bringup_builds_the_design(no_leftovers):
    topo = load_topology(TOPO)
    with Fabric(topo) as fab:
        names = {ep.name for ep in fab.endpoints}
        assert set(find_leftovers().namespaces) == names  # every namespace is named dpt-*
        for ep in fab.endpoints:
            ifs = _ifaces(ep.name) - {"lo"}
            assert ifs == {n.dev for n in ep.nics}, ep.name
            if ep.kind == "engine":  # its only interface is its CNIC
                assert ifs == {ep.nic("cnic").dev}
            if ep.kind == "host":
                assert {n.kind for n in ep.nics} == {"host_port", "snic"}
        for nic in fab.nics:
            assert nic.dev.startswith(PREFIX) and nic.bridge_dev.startswith(PREFIX)
            # both directions shaped at the configured rate
            assert _htb_rate_bits(nic.dev, nic.ns, "1:1") == nic.rate_bps
            assert _htb_rate_bits(nic.bridge_dev, None, "1:1") == nic.rate_bps
            classes = set(parse_class_stats(run(["tc", "-s", "class", "show", "dev", nic.dev], ns=nic.ns)))
            two = nic.kind in ("cnic", "host_port")
            assert classes == ({"1:1", "1:10", "1:20"} if two else {"1:1", "1:10"})
        # nftables marks the kv port range in host and engine namespaces
        assert "dscp set af11" in run(["nft", "list", "ruleset"], ns="dpt-p0e0")
        # the compute and storage networks are separate bridges
        cbr = run(["ip", "-br", "link", "show", "master", f"{PREFIX}-cbr"])
        assert f"{PREFIX}-cbr-p0e0" in cbr and f"{PREFIX}-sbr-p0" not in cbr
        # only what lives in the testbed's namespaces (or is its tagged shell) is a leftover:
        # never this test's own process tree in the root namespace
        left = find_leftovers().processes
        assert os.getpid() not in left and os.getppid() not in left
        here = os.stat("/proc/self/ns/net").st_ino
        untagged_here = [p for p in left if os.stat(f"/proc/{p}/ns/net").st_ino == here
                         and b"mininet:" not in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert untagged_here == []
    assert find_leftovers().empty()


def test_gso_cap_and_tcp_settings_reach_the_sending_ends(no_leftovers):
    """gso_max_bytes caps what the CNICs and host ports send into HTB (the SNICs keep the
    kernel's 64 KiB), and every namespace has TCP's tail loss probes off."""
    import re
    from dataclasses import replace

    topo = load_topology(REPO / "topologies" / "1p1d-isolation.yaml")
    topo = replace(topo, spec=topo.spec.model_copy(update={"gso_max_bytes": 12000}))
    with Fabric(topo) as fab:
        for nic in fab.nics:
            out = run(["ip", "-d", "link", "show", "dev", nic.dev], ns=nic.ns)
            gso = int(re.search(r"gso_max_size (\d+)", out).group(1))
            assert gso == (12000 if nic.kind in ("cnic", "host_port") else 65536), (nic.dev, gso)
        for ep in fab.endpoints:
            assert run(["sysctl", "-n", "net.ipv4.tcp_early_retrans"], ns=ep.name).strip() == "0", ep.name


def test_qos_off_collapses_cnics_to_one_class(no_leftovers):
    with Fabric(load_topology(TOPO)) as fab:
        fab.apply_shaping(False)
        nic = fab.endpoint("p0e0").nic("cnic")
        classes = set(parse_class_stats(run(["tc", "-s", "class", "show", "dev", nic.bridge_dev])))
        assert classes == {"1:1", "1:10"}


def test_teardown_runs_when_the_body_raises(no_leftovers):
    with pytest.raises(RuntimeError, match="boom"):
        with Fabric(load_topology(TOPO)):
            assert not find_leftovers().empty()
            raise RuntimeError("boom")
    assert find_leftovers().empty()


def test_a_second_fabric_is_refused_and_leaves_the_first_intact(no_leftovers):
    """Same names: building over a live testbed would fail half-way, and the half-built one's
    teardown would delete the first one's bridges."""
    with Fabric(load_topology(TOPO)):
        before = find_leftovers()
        with pytest.raises(FabricBusy, match="another testbed is up.*dualpath clean"):
            with Fabric(load_topology(TOPO)):
                pass
        after = find_leftovers()
        assert (after.namespaces, after.bridges, after.links) == (before.namespaces, before.bridges, before.links)
    assert find_leftovers().empty()


def _is_zombie(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")


def _start_runner() -> subprocess.Popen:
    # Started as a shell script's background job would be: with SIGINT ignored. Ctrl-C (or
    # kill -INT) must still tear down.
    p = subprocess.Popen([*CLI, "up", str(TOPO), "--hold", "60"], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    line = p.stdout.readline()  # "up in N s" once everything exists
    assert line.startswith("up in"), (line, p.stderr.read() if p.poll() is not None else "")
    return p


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_runner_killed_leaves_nothing_after_clean(no_leftovers, how):
    p = _start_runner()
    # a process inside a namespace, as an experiment would have
    stray = int(run(["bash", "-c", "sleep 120 >/dev/null 2>&1 & echo $!"], ns="dpt-p0e0"))
    p.send_signal(getattr(signal, how))
    p.wait(timeout=30)
    if how == "SIGKILL":
        left = find_leftovers()
        assert stray in left.processes and "dpt-p0e0" in left.namespaces
        r = dualpath("clean")
        assert r.returncode == 0, r.stderr
    else:
        assert p.returncode == 130
    assert find_leftovers().empty()
    assert not Path(f"/proc/{stray}").exists() or _is_zombie(stray)


def test_up_refuses_over_a_live_testbed_and_over_leftovers(no_leftovers):
    """A second bring-up names the live one's owner; with no owner, it names what a dead run
    left and points at `dualpath clean`. Nothing is built over either, and the refused command
    leaves no claim behind."""
    from testbed.fabric import rundir

    p = _start_runner()
    try:
        r = dualpath("up", str(TOPO), "--hold", "1")
        assert r.returncode == 1 and f"already up, owned by pid {p.pid}" in r.stderr, r.stderr
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(timeout=30)
    run(["ip", "netns", "add", f"{PREFIX}-zleft"])
    try:
        r = dualpath("up", str(TOPO), "--hold", "1")
        assert r.returncode == 1 and "leftovers of an earlier run exist (1 namespaces)" in r.stderr, r.stderr
        assert "dualpath clean" in r.stderr and not rundir.RUN_DIR.exists()
    finally:
        run(["ip", "netns", "del", f"{PREFIX}-zleft"], check=False)


def test_non_root_user_gets_a_clear_message():
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *CLI, "check"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "needs root" in r.stderr and "Traceback" not in r.stderr
