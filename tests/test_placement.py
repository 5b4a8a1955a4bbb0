"""A topology over several servers: placement, what crosses each pair, tunnels and MTU (pure), and
the commands that read it: `dualpath topo`, `dualpath cluster prepare`, `dualpath clean TOPOLOGY`."""
import copy
import sys
import socket
import subprocess

import pytest
import yaml

from testbed import placement
from testbed.topology import TopologyError, load_topology, parse_topology
from tests.conftest import REPO, dualpath, needs_root

EXAMPLE = REPO / "topologies" / "cluster" / "1p1d-two-servers.yaml"
RAW = yaml.safe_load(EXAMPLE.read_text())


def _topo(**changes):
    raw = copy.deepcopy(RAW)
    raw.update(changes)
    return parse_topology(raw)


def test_example_places_d0_on_the_second_server():
    t = load_topology(EXAMPLE)
    assert placement.placement(t) == {"p0": "a", "d0": "b", "s0": "a"}
    assert placement.spans_servers(t)
    assert placement.server_of_namespace(t, "dpt-d0e1") == "b"
    assert placement.server_of_namespace(t, "dpt-p0") == "a"
    assert placement.problems(t) == []


def test_crossing_is_the_smaller_side_per_bridge():
    t = load_topology(EXAMPLE)
    (c,) = placement.crossings(t)
    node = 2 * t.cnic_bps + t.host_port_bps  # either node's compute ends
    assert (c.a, c.b, c.compute_bps) == ("a", "b", node)
    assert c.storage_bps == t.snic_bps  # d0's one SNIC, less than a's SNIC + storage NIC
    assert c.physical_bps == 10_000_000_000 and c.holds


def test_a_slow_physical_nic_is_a_problem():
    raw = copy.deepcopy(RAW)
    raw["servers"][1]["nic_gbps"] = 1
    t = parse_topology(raw)
    (c,) = placement.crossings(t)
    assert not c.holds
    assert any("exceeds the slower NIC" in p for p in placement.problems(t))


def test_mtu_needs_room_for_gre():
    t = _topo(mtu=9000, tunnel="gretap")
    (p,) = placement.mtu_problems(t)
    assert "path MTU of 9042" in p and "at most 8958" in p
    assert placement.mtu_problems(_topo(mtu=8958, tunnel="gretap")) == []
    assert placement.mtu_problems(_topo(mtu=8958, tunnel="vxlan"))  # VXLAN's 50 B do not fit
    assert placement.mtu_problems(_topo(mtu=8950, tunnel="vxlan")) == []


def test_tunnels_one_per_bridge_and_pair_with_distinct_keys():
    raw = copy.deepcopy(RAW)
    raw["servers"].append({"name": "c", "ssh": "root@192.168.50.13", "nic_gbps": 10, "mtu": 9000})
    raw["storage"]["servers"] = 2
    raw["place"] = {"d0": "b", "s1": "c"}
    t = parse_topology(raw)
    tun = placement.tunnels(t)
    pairs = {(x.a, x.b) for x in tun}
    assert pairs == {("a", "b"), ("a", "c"), ("b", "c")}
    assert len(tun) == 6 and len({x.key for x in tun}) == 6 and len({x.dev for x in tun}) == 6
    assert all(len(x.dev) <= 15 and x.dev.startswith("dpt-") for x in tun)


def test_without_servers_everything_is_local():
    t = load_topology(REPO / "topologies" / "1p1d.yaml")
    assert set(placement.placement(t).values()) == {"local"}
    assert not placement.spans_servers(t) and placement.crossings(t) == [] and placement.describe(t) == []


@pytest.mark.parametrize("change, words", [
    ({"place": {"d9": "b"}}, "not a node or storage server"),
    ({"place": {"d0": "zz"}}, "not in servers"),
    ({"servers": [{"name": "a", "ssh": "root@x"}, {"name": "b", "ssh": "root@y"}]}, "first server is this machine"),
    ({"servers": [{"name": "a"}, {"name": "a", "ssh": "root@y"}]}, "two servers are named"),
    ({"servers": [{"name": "a"}, {"name": "b", "ssh": "-oProxyCommand=x"}]}, "ssh"),
    ({"servers": [{"name": "a"}, {"name": "b", "ssh": "root@y", "python": "venv/bin/python"}]}, "python"),
    ({"servers": [], "place": {"d0": "b"}}, "needs a servers"),
    ({"hosts": "docker"}, "hosts: namespaces only"),
])
def test_bad_placement_is_one_line_naming_the_field(change, words):
    raw = copy.deepcopy(RAW)
    raw.update(change)
    with pytest.raises(TopologyError) as e:
        parse_topology(raw, source="t.yaml")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("t.yaml: field") and words in msg


def test_topo_prints_each_server_and_fails_on_a_problem(tmp_path):
    r = dualpath("topo", str(EXAMPLE))
    assert r.returncode == 0, r.stderr
    assert "b (ssh root@192.168.50.12; NIC 10 Gbit/s, path MTU 9000): d0 (2 engines)" in r.stdout
    assert "a <-> b: at most 2.61 Gbit/s each way" in r.stdout and "holds" in r.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**RAW, "mtu": 9000}))
    r = dualpath("topo", str(bad))
    assert r.returncode == 1 and "PROBLEM: servers a and b" in r.stdout and "Traceback" not in r.stderr


def test_each_server_fabric_holds_only_its_part():
    from testbed.fabric.network import Fabric

    lead, part = Fabric(load_topology(EXAMPLE)), Fabric(load_topology(EXAMPLE), server="b")
    here, there = {"dpt-p0", "dpt-p0e0", "dpt-p0e1", "dpt-s0"}, {"dpt-d0", "dpt-d0e0", "dpt-d0e1"}
    assert {e.name for e in lead.local_endpoints} == here
    assert {e.name for e in lead.endpoints} == here | there  # the leader's processes and counters: all
    assert {e.name for e in part.endpoints} == {e.name for e in part.local_endpoints} == there
    assert [v.name for v in lead.remotes] == ["b"] and part.remotes == [] and part.is_remote_part
    assert lead.server_of("dpt-d0e1").name == "b" and lead.server_of("dpt-p0e0") is None
    argv = lead.exec_argv("dpt-d0e0", [sys.executable, "-m", "x"], env={"A": "1 2"})
    assert argv[0] == "ssh" and argv[-2] == "root@192.168.50.12"
    assert argv[-1].endswith(f"exec env A='1 2' ip netns exec dpt-d0e0 {sys.executable} -m x")  # same path: no python:
    assert lead.exec_argv("dpt-p0e0", ["true"]) == ["ip", "netns", "exec", "dpt-p0e0", "true"]
    with pytest.raises(ValueError, match="no server"):
        Fabric(load_topology(EXAMPLE), server="zz")


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from dualpath.model.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("ck") / "tiny", seed=0, kind="qwen2", num_hidden_layers=2)


def _cluster_on(raw: dict, run_dir, ckpt):
    """A Cluster over a fabric plan, built the one way a run builds it; nothing is started."""
    from testbed.cluster.processes import Cluster
    from testbed.cluster.runclock import run_geometry
    from testbed.fabric.network import Fabric

    return Cluster.for_topology(Fabric(parse_topology(raw)), run_dir, ckpt, run_geometry(ckpt))


def test_a_storage_server_elsewhere_starts_there_with_its_folder_on_that_server(tmp_path, tiny_ckpt):
    raw = copy.deepcopy(RAW)
    raw["place"] = {"s0": "b"}
    c = _cluster_on(raw, tmp_path, tiny_ckpt)
    try:
        ep = next(e for e in c.fab.endpoints if e.kind == "storage")
        sp = c._store_process(ep, [])
        root = tmp_path / "store" / "dpt-s0"
        assert sp.argv[0] == "ssh" and sp.argv[-2] == "root@192.168.50.12"
        assert f"ip netns exec dpt-s0 {sys.executable} -m emulators.kvstore" in sp.argv[-1]
        assert f"--root {root}" in sp.argv[-1] and "PYTHONPATH=" in sp.argv[-1]
        assert not sp.root_here and c.remote_roots == {root: (c.fab.server_of("dpt-s0"), "dpt-s0")}
    finally:
        c.loop.close()


def test_a_storage_server_here_keeps_its_folder_here(tmp_path, tiny_ckpt):
    c = _cluster_on(copy.deepcopy(RAW), tmp_path, tiny_ckpt)
    try:
        sp = c._store_process(next(e for e in c.fab.endpoints if e.kind == "storage"), [])
        assert sp.argv[:4] == ["ip", "netns", "exec", "dpt-s0"] and sp.root_here and c.remote_roots == {}
    finally:
        c.loop.close()


def test_a_disk_full_store_elsewhere_is_refused(tmp_path, tiny_ckpt):
    raw = copy.deepcopy(RAW)
    raw["place"] = {"s0": "b"}
    c = _cluster_on(raw, tmp_path, tiny_ckpt)
    c.tmpfs_stores = {"dpt-s0": 1 << 20}
    try:
        with pytest.raises(ValueError, match="disk-full fault on dpt-s0 needs it on this server"):
            c._store_process(next(e for e in c.fab.endpoints if e.kind == "storage"), [])
        assert c.disk_mounts == {}
    finally:
        c.loop.close()


def test_a_fault_on_another_server_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "t.yaml"
    bad.write_text(yaml.safe_dump({**RAW, "place": {"d0": "b", "s0": "b"}}))
    for fault, target in (("de-kill@1", "dpt-d0e0"), ("store-crash@1", "dpt-s0"), ("snic-down:d0@1", "dpt-d0")):
        r = dualpath("run", str(bad), "--fault", fault, "--modes", "dualpath")
        assert r.returncode == 2 and f"{target} runs on server b" in r.stderr, (fault, r.stderr)
        assert "Traceback" not in r.stderr

def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unreachable(tmp_path):
    """The example with its second server at a loopback port nothing listens on."""
    raw = copy.deepcopy(RAW)
    raw["servers"][1].update(ssh="root@127.0.0.1", port=_closed_port())
    p = tmp_path / "two.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


@needs_root
def test_prepare_checks_this_machine_and_names_an_unreachable_server(tmp_path):
    r = dualpath("cluster", "prepare", str(_unreachable(tmp_path)), timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for check in ("root", "checkout", "python", "tools", "vxlan", "bridge", "htb"):
        assert any(ln.startswith(f"a: {check}: ") for ln in lines), (check, r.stdout)
    assert any(ln.startswith("b: PROBLEM ssh: cannot run commands there") for ln in lines), r.stdout
    assert lines[-1].startswith("2 servers, ") and "1 problem(s)" in lines[-1]
    assert "Traceback" not in r.stderr
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert "dpt-prep" not in links  # the checks' gretap, bridge and veth are gone


@needs_root
def test_clean_with_a_topology_reports_the_server_it_could_not_reach(tmp_path):
    r = dualpath("clean", str(_unreachable(tmp_path)), timeout=120)
    assert r.returncode == 1 and "b: PROBLEM clean:" in r.stdout, r.stdout + r.stderr
    assert "Traceback" not in r.stderr


def test_prepare_wants_a_topology_with_servers():
    r = dualpath("cluster", "prepare", str(REPO / "topologies" / "1p1d.yaml"))
    assert r.returncode in (1, 2) and "Traceback" not in r.stderr


def test_the_run_report_says_where_each_node_ran_and_with_which_kernels():
    from testbed.experiments.ablation import cluster_summary
    from testbed.measure.report import cluster_lines

    assert cluster_lines({"modes": {}}) == []
    t = load_topology(REPO / "topologies" / "cluster" / "1p1d-two-servers.yaml")
    summary = {"cluster": cluster_summary(t),
               "modes": {"basic": {"cpu_busy_other_servers": {"b": 0.42}}, "oracle": {"cpu_busy_other_servers": {"b": None}}}}
    lines = cluster_lines(summary)
    assert lines[0].startswith("servers: a ran p0, s0; b ran d0; ")
    assert ("portable kernels (MKL_CBWR=COMPATIBLE" in lines[0]) == summary["cluster"]["kernels"]["portable"]
    assert lines[1] == "other servers' CPU busy over each mode: basic b 42%; oracle b unread"
