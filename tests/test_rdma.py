"""RDMA (Soft-RoCE): asking for it where it cannot work fails loudly and names the cause; the
rxe counters, not the configuration, decide whether the KV crossed RDMA; RoCE's headers are
counted per packet; the VM tooling and the Vagrantfile stay in step.

On this machine kind the kernel has no RDMA, so everything here runs without a VM: the
failures for real, the proof against counters laid out as the kernel lays them out. The real
rxe runs are `make vm-test` (scripts/vm/guest_test.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dualpath.traffic_classes import KV, MODEL
from dualpath.transport import Agent, RdmaUnavailableError, build_ucx_env, rdma_devices
from dualpath.transport import rdma
from tests.conftest import REPO, dualpath, needs_root

NO_RDMA = pytest.mark.skipif(bool(rdma_devices()), reason="this kernel has RDMA devices")


def fake_sysfs(root: Path, devices: dict[str, dict[str, int]], gids: dict[str, list[tuple[str, str]]] | None = None):
    for dev, counters in devices.items():
        hw = root / dev / "ports" / "1" / "hw_counters"
        hw.mkdir(parents=True)
        for k, v in counters.items():
            (hw / k).write_text(f"{v}\n")
        for i, (gid, kind) in enumerate((gids or {}).get(dev, [])):
            (root / dev / "ports" / "1" / "gids").mkdir(parents=True, exist_ok=True)
            (root / dev / "ports" / "1" / "gid_attrs" / "types").mkdir(parents=True, exist_ok=True)
            (root / dev / "ports" / "1" / "gids" / str(i)).write_text(gid + "\n")
            (root / dev / "ports" / "1" / "gid_attrs" / "types" / str(i)).write_text(kind + "\n")
    return root


# ---- the loud failure ------------------------------------------------------------------------
@NO_RDMA
def test_rdma_here_names_both_causes_and_never_starts_nixl():
    """No RDMA device on this kernel, and this process has no system libibverbs preloaded:
    the error names both, and says it does not fall back to TCP."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    code = ("from dualpath.transport import Agent\n"
            "Agent('rdma-probe', 'lo', 'kv', 'rdma')\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "RdmaUnavailableError" in p.stderr
    assert "no RDMA device" in p.stderr
    assert "system libibverbs is not preloaded" in p.stderr and "silently" in p.stderr
    assert "does not fall back to TCP" in p.stderr


@NO_RDMA
@pytest.mark.skipif(not Path(rdma.SYSTEM_LIBIBVERBS).exists(), reason="no system libibverbs here")
def test_preloaded_process_is_told_only_what_is_still_missing():
    """With the system libibverbs really preloaded (LD_PRELOAD, mapped: /proc/self/maps), the
    only cause left on this kernel is the missing device."""
    env = dict(os.environ, LD_PRELOAD=rdma.SYSTEM_LIBIBVERBS)
    code = ("from dualpath.transport import rdma\n"
            "assert rdma.preloaded_libibverbs(), 'not seen as preloaded'\n"
            "from dualpath.transport import Agent\n"
            "Agent('rdma-probe', 'lo', 'kv', 'rdma')\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "not seen as preloaded" not in p.stderr
    assert "no RDMA device" in p.stderr
    assert "libibverbs" not in p.stderr.split("RdmaUnavailableError", 1)[1]


def test_a_device_without_the_preload_is_refused(tmp_path, monkeypatch):
    """The VM's case the counters would otherwise have to catch: an rxe device on the agent's
    interface, but a process with NIXL's bundled libibverbs. Refused before NIXL starts."""
    sysfs = fake_sysfs(tmp_path, {"dpt-p0e0-rxe": {"sent_pkts": 0}})
    monkeypatch.setattr(rdma, "SYSFS", sysfs)
    monkeypatch.setattr(rdma, "devices", lambda sysfs=sysfs: ["dpt-p0e0-rxe"])
    monkeypatch.setattr(rdma, "device_for", lambda iface, names=None: "dpt-p0e0-rxe")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv(rdma.ALLOW_UNPRELOADED, raising=False)
    with pytest.raises(RdmaUnavailableError) as e:
        Agent("rdma-probe", "dpt-p0e0-cnic", "kv", "rdma")
    msg = str(e.value)
    assert "system libibverbs is not preloaded" in msg and "rdma-core 48" in msg
    assert f"LD_PRELOAD={rdma.SYSTEM_LIBIBVERBS}" in msg
    assert "no RDMA device" not in msg


def test_preload_detection_needs_the_library_named_and_mapped():
    lib = os.path.realpath(rdma.SYSTEM_LIBIBVERBS)
    assert not rdma.preloaded_libibverbs({}, maps=f"7f00 r-xp {lib}\n")  # mapped as a dependency only
    assert not rdma.preloaded_libibverbs({"LD_PRELOAD": rdma.SYSTEM_LIBIBVERBS}, maps="nothing")
    assert rdma.preloaded_libibverbs({"LD_PRELOAD": f"/x/other.so {rdma.SYSTEM_LIBIBVERBS}"}, maps=f"7f00 {lib}\n")
    env = rdma.preload_env({"LD_PRELOAD": "/x/other.so"})
    assert env["LD_PRELOAD"].split()[0] == rdma.SYSTEM_LIBIBVERBS and "/x/other.so" in env["LD_PRELOAD"]


def test_no_device_on_the_interface_is_named(monkeypatch):
    monkeypatch.setattr(rdma, "devices", lambda sysfs=None: ["dpt-d0e0-rxe"])
    monkeypatch.setattr(rdma, "device_for", lambda iface, names=None: None)
    dev, why = rdma.problems("dpt-p0e0-cnic", environ={"LD_PRELOAD": rdma.SYSTEM_LIBIBVERBS})
    assert dev is None and any("no RDMA device on interface 'dpt-p0e0-cnic'" in w for w in why)


# ---- what UCX is told ------------------------------------------------------------------------
def test_device_names_fit_ucx_and_a_longer_one_is_refused_loudly():
    # UCX cuts a device name at 15 characters (UCT_MD_NAME_MAX 16 with the NUL); the cut name
    # matches nothing in UCX_NET_DEVICES and UCX runs on TCP without a word (measured in the VM)
    assert rdma.rxe_device_name("dpt-p0e0") == "dpt-p0e0-rxe"
    assert len(rdma.rxe_device_name("dpt-p99e99")) <= rdma.UCX_DEVICE_NAME_MAX == 15
    with pytest.raises(ValueError, match="UCT_MD_NAME_MAX"):
        rdma.rxe_device_name("dpt-p0e0-cnic")  # the old <veth>-rxe scheme: 17 characters
    with pytest.raises(RdmaUnavailableError, match="silently move every byte over TCP"):
        build_ucx_env("dpt-p0e0-cnic", "kv", "rdma", rdma_device="dpt-p0e0-cnic-rxe", base={})
    build_ucx_env("dpt-p0e0-cnic", "kv", "rdma", rdma_device="x" * 15, base={})  # the longest that fits


def test_every_rdma_nic_of_the_shipped_topologies_gets_a_name_ucx_can_use():
    from testbed.fabric.network import Fabric
    from testbed.topology import load_topology

    for path in sorted((Path(__file__).resolve().parents[1] / "topologies").glob("*.yaml")):
        fab = Fabric(load_topology(path), "rdma")
        names = [rdma.rxe_device_name(n.ns) for n in fab.rdma_nics()]
        assert len(set(names)) == len(names), path.name  # one RDMA NIC per namespace
        assert all(len(x) <= rdma.UCX_DEVICE_NAME_MAX for x in names), path.name


def test_rdma_env_rc_verbs_with_the_class_in_the_traffic_class():
    env = build_ucx_env("dpt-p0e0-cnic", "kv", "rdma", rdma_device="dpt-p0e0-rxe", base={})
    # ud_verbs: wire-up only (rc_verbs alone cannot connect); no tcp, over which UCX would put
    # half of every large WRITE beside the RDMA lane
    assert env["UCX_TLS"] == "rc_verbs,ud_verbs" and "tcp" not in env["UCX_TLS"]
    assert env["UCX_NET_DEVICES"] == "dpt-p0e0-rxe:1"  # the rxe device alone: no TCP device to stripe over
    assert env["UCX_IB_TRAFFIC_CLASS"] == str(KV.dscp << 2) == "40"  # rxe: TOS 0x28, AF11
    assert "UCX_MODULES" not in env  # the ib module must load
    model = build_ucx_env("x", "model", "rdma", rdma_device="d", base={})
    assert model["UCX_IB_TRAFFIC_CLASS"] == str(MODEL.dscp << 2) == "184"


def test_rdma_env_waits_longer_than_a_starved_ack_before_resending():
    """UCX's 1 s ack timeout re-sent packets that had arrived on a starved host (s25-vm: retries by
    timeout, duplicates at the responders, NIC bytes up to 8.4 % over the paths)."""
    from dualpath.transport.env import RC_TIMEOUT

    env = build_ucx_env("c", "kv", "rdma", rdma_device="d", base={})
    assert env["UCX_RC_TIMEOUT"] == RC_TIMEOUT and float(RC_TIMEOUT.rstrip("s")) >= 10
    assert "UCX_RC_TIMEOUT" not in build_ucx_env("c", "kv", "tcp", base={})  # TCP has its own RTO
    mine = build_ucx_env("c", "kv", "rdma", rdma_device="d", base={"UCX_RC_TIMEOUT": "2s"})
    assert "UCX_RC_TIMEOUT" not in mine  # the user's own value, already in the environment, wins


# ---- the proof -------------------------------------------------------------------------------
def test_counters_read_as_the_kernel_lays_them_out(tmp_path):
    sysfs = fake_sysfs(tmp_path, {"a-rxe": {"sent_pkts": 5, "rcvd_pkts": 7, "sent_bytes": 100},
                                  "b-rxe": {"sent_pkts": 1}},
                       gids={"a-rxe": [("fe80:0000:0000:0000:1c7f:dbff:fe1b:d3c5", "RoCE v2"),
                                       ("0000:0000:0000:0000:0000:ffff:0a4d:0002", "RoCE v2")]})
    c = rdma.read_counters(sysfs)
    assert c == {"a-rxe": {"sent_pkts": 5, "rcvd_pkts": 7, "sent_bytes": 100}, "b-rxe": {"sent_pkts": 1}}
    assert rdma.ipv4_gid_index("a-rxe", sysfs=sysfs) == 1  # IPv4: HTB's u32 sees its DS field
    d = rdma.counters_delta({"a-rxe": {"sent_pkts": 9}}, {"a-rxe": {"sent_pkts": 5}})
    assert d == {"a-rxe": {"sent_pkts": 4}}


def test_the_proof_sums_the_rc_re_sends_of_every_device():
    delta = {"a-rxe": {"sent_pkts": 3000, "completer_retry_err": 9, "rcvd_seq_err": 3},
             "b-rxe": {"sent_pkts": 10, "duplicate_request": 87, "out_of_seq_request": 6},
             "c-rxe": {"sent_pkts": 5, "duplicate_request": 13}}
    proof = rdma.prove(delta, {"a-rxe": 8 << 20}, 4096)
    assert proof["retries"] == {"completer_retry_err": 9, "rcvd_seq_err": 3, "duplicate_request": 100,
                                "out_of_seq_request": 6}


def test_silent_tcp_fallback_is_not_proven():
    """The measured failure: data intact, sent_pkts 0. The message says so and names the cure."""
    delta = {"ini-rxe": {"sent_pkts": 0, "rcvd_pkts": 0}, "tgt-rxe": {"sent_pkts": 0, "rcvd_pkts": 0}}
    proof = rdma.prove(delta, {"ini-rxe": 8 << 20, "tgt-rxe": 4 << 20}, 4096)
    assert not proof["rdma_proven"] and proof["rxe_sent_pkts"] == 0
    msg = rdma.not_proven_message(proof, "the test")
    assert "did not cross RDMA" in msg and "ini-rxe" in msg and "fell back to TCP" in msg
    assert rdma.SYSTEM_LIBIBVERBS in msg


def test_enough_roce_packets_prove_it_and_a_tcp_share_does_not():
    need = -(-(8 << 20) // 4096)
    ok = rdma.prove({"a": {"sent_pkts": need + 40}, "b": {"sent_pkts": 30}}, {"a": 8 << 20, "b": 0}, 4096,
                    kv_class_pkts={"a": need + 45, "b": 30})
    assert ok["rdma_proven"], ok
    # half the KV over TCP: enough RoCE packets for a 4096 MTU check alone, but the kv class
    # holds many TCP segments beside them
    half = rdma.prove({"a": {"sent_pkts": need}}, {"a": 8 << 20}, 4096, kv_class_pkts={"a": need * 2})
    assert not half["rdma_proven"] and "were RoCE" in half["devices"][0]["why"]
    few = rdma.prove({"a": {"sent_pkts": need // 2}}, {"a": 8 << 20}, 4096)
    assert not few["rdma_proven"] and "fewer than" in few["devices"][0]["why"]
    nothing = rdma.prove({"a": {"sent_pkts": 0}}, {"a": 0}, 4096)
    assert not nothing["rdma_proven"]  # nothing moved proves nothing
    assert "nothing was proven" in rdma.not_proven_message(nothing)


def test_rxe_mtu_follows_the_kernel():
    assert rdma.rxe_mtu(9000) == 4096 and rdma.rxe_mtu(1500) == 1024 and rdma.rxe_mtu(1100) == 512


def test_roce_headers_are_counted_per_packet(monkeypatch):
    """kv payload on a NIC = wire bytes - 58 per RoCE packet (rxe's own count) - 66 per TCP one."""
    from testbed.fabric import counters
    from testbed.fabric.network import Nic

    nic = Nic("cnic", "dpt-p0e0", "dpt-p0e0-cnic", "dpt-cbr-p0e0", "10.77.0.2", 10**9, True)

    class Fab:
        nics = [nic]
        qos = True
        rxe = {nic.dev: "dpt-p0e0-rxe"}

        def rxe_of(self, n):
            return self.rxe.get(n.dev)

    roce_tx, tcp_tx, roce_rx = 1000, 10, 300
    wire_tx = roce_tx * (4096 + 58) + tcp_tx * (200 + 66)
    wire_rx = roce_rx * (4096 + 58)
    monkeypatch.setattr(counters, "class_counters", lambda dev, ns=None: {
        "1:20": (wire_tx, roce_tx + tcp_tx, 0) if ns else (wire_rx, roce_rx, 0), "1:10": (500, 5, 0)})
    monkeypatch.setattr(rdma, "read_counters", lambda *a, **k: {
        "dpt-p0e0-rxe": {"sent_pkts": roce_tx, "rcvd_pkts": roce_rx}})
    snap = counters.snapshot(Fab())
    assert snap.kv_payload[("dpt-p0e0", "cnic", "tx")] == roce_tx * 4096 + tcp_tx * 200
    assert snap.kv_payload[("dpt-p0e0", "cnic", "rx")] == roce_rx * 4096
    assert snap.roce_pkts[("dpt-p0e0", "cnic", "tx")] == roce_tx
    assert snap.rxe == {"dpt-p0e0-rxe": {"sent_pkts": roce_tx, "rcvd_pkts": roce_rx}}


# ---- the CLI, for real, on a kernel without RDMA (root: it creates namespaces) --------------
@NO_RDMA
@needs_root
def test_bench_transport_rdma_fails_loudly_here(no_leftovers):
    r = dualpath("bench", "transport", "--transport", "rdma", timeout=180)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "rxe" in r.stderr and "does not fall back to TCP" in r.stderr
    assert "transport over rxe" not in r.stdout  # nothing was measured, over TCP or otherwise


@NO_RDMA
@needs_root
def test_check_rdma_fails_loudly_here(no_leftovers):
    r = dualpath("check", "--rdma", timeout=180)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "RDMA: NOT proven" in r.stdout
    assert "no RDMA device support usable in a network namespace" in r.stdout


# ---- the VM tooling and the Vagrantfile --------------------------------------------------------
def test_vm_scripts_parse_and_share_one_provisioning_script():
    for f in ["scripts/vm.sh", "scripts/vm/build.sh", "scripts/vm/provision.sh", "scripts/vm/vminit",
              "scripts/vm/mkinitrd.sh", "scripts/vm/vm-test.sh"]:
        subprocess.run(["bash", "-n", str(REPO / f)], check=True)
    pkgs = subprocess.run(["bash", str(REPO / "scripts/vm/provision.sh"), "packages"], capture_output=True,
                          text=True, check=True).stdout.strip().split(",")
    assert {"rdma-core", "perftest", "ibverbs-providers", "mininet", "python3-pyverbs"} <= set(pkgs)
    vf = (REPO / "Vagrantfile").read_text()
    assert "scripts/vm/provision.sh" in vf and '"vagrant"' in vf
    assert "provision.sh" in (REPO / "scripts/vm/build.sh").read_text()
    for f in ["scripts/vm.sh", "scripts/vm/build.sh", "scripts/vm/provision.sh", "Vagrantfile"]:
        text = (REPO / f).read_text()
        assert "deb.debian.org" not in text and "http://" not in text, f"{f} names a mirror"


@pytest.mark.skipif(shutil.which("ruby") is None, reason="no ruby (apt-get install ruby)")
def test_vagrantfile_syntax():
    p = subprocess.run(["ruby", "-c", str(REPO / "Vagrantfile")], capture_output=True, text=True)
    assert p.returncode == 0 and "Syntax OK" in p.stdout, p.stderr


def test_fallback_control_counts_only_a_failure_the_counters_saw(monkeypatch):
    """The negative control of `check --rdma` is caught only when the rxe devices were read and
    sent too few packets; counters that could not be read at all (measured in the VM, from
    inside an engine's namespace) fail every run alike, and so tell nothing."""
    import testbed.calibrate.benches as benches
    from testbed.calibrate.rdma_preflight import _fallback_control

    unread = rdma.prove({}, {"a": 8 << 20}, 4096)
    silent = rdma.prove({"a": {"sent_pkts": 0}}, {"a": 8 << 20}, 4096)
    assert "no hw_counters read" in unread["devices"][0]["why"]
    for proof, caught in ((unread, False), (silent, True)):
        res = {"rdma": proof, "check": {"ok": True}, "bytes_moved": {"WRITE": 8 << 20},
               "error": "RdmaNotProvenError: " + rdma.not_proven_message(proof)}
        monkeypatch.setattr(benches, "_transport_pair", lambda *a, res=res, **k: res)
        assert _fallback_control(object(), progress=lambda m: None)["caught"] is caught


def test_pinned_memory_that_does_not_fit_is_refused_before_anything_starts():
    meminfo = "MemTotal:        6000000 kB\nMemAvailable:    5000000 kB\n"
    assert rdma.pinned_memory_problem(2 << 30, meminfo) is None  # 2 GiB of 4.8 available
    why = rdma.pinned_memory_problem(9 << 30, meminfo)  # 1p1d.yaml's 2 x 4 GiB + 4 x 1 GiB (VM: ibv_reg_mr failed)
    assert why and "9.00 GiB" in why and "dram_buffer_gib" in why
    assert rdma.pinned_memory_problem(9 << 30, "MemTotal: 1 kB\n") is None  # unknown: the device decides


def test_the_rxe_topology_pins_what_the_vm_can_hold():
    from testbed.topology import load_topology

    s = load_topology(REPO / "topologies" / "1p1d-rxe.yaml").spec
    pinned = (s.prefill_nodes + s.decode_nodes) * (s.dram_buffer_gib + s.engines_per_node * s.hbm_gib_per_engine)
    assert pinned * 2**30 <= 0.8 * 4.5 * 2**30  # scripts/vm.sh gives the guest 6 GiB (--mem 6144)


def test_fallback_control_counts_an_agent_ucx_refused_as_caught(monkeypatch):
    """Without tcp in UCX_TLS an unpreloaded agent cannot fall back: UCX finds no transport and
    the initiator dies (measured in the VM: exit -11 after "no usable transports/devices")."""
    import testbed.calibrate.benches as benches
    from testbed.calibrate.rdma_preflight import _fallback_control

    def refuse(*a, **k):
        raise RuntimeError("transport benchmark initiator failed (exit -11): ucp_context.c:1770 UCX ERROR no "
                           "usable transports/devices (asked rc_verbs,ud_verbs on network:dpt-p0e0-rxe:1)")

    def other(*a, **k):
        raise RuntimeError("transport benchmark initiator failed (exit 1): something else")

    monkeypatch.setattr(benches, "_transport_pair", refuse)
    got = _fallback_control(object(), progress=lambda m: None)
    assert got["caught"] is True and got["how"] == "refused" and "no usable transports" in got["error"]
    monkeypatch.setattr(benches, "_transport_pair", other)
    assert _fallback_control(object(), progress=lambda m: None)["caught"] is False
