"""Byte accounting per path: the derived numbers must be DESIGN.md section 7's table."""
import pytest

from dualpath.accounting import (
    NODE_NICS, PATHS, Nic, RequestBytes, compare, expected_bytes, expected_totals, format_compare, hops,
    request_bytes, table,
)
from dualpath.scheduler import ReadPath

H, M, W = 1_000_003, 20_011, 4_096  # distinct, so a hop using the wrong variable cannot pass

# DESIGN.md section 7, written out by hand (not derived): (NIC, direction) -> bytes. Everything
# not listed must be 0. The storage side is the other end of the SNIC hops.
DESIGN_PE = {
    (Nic.PE_SNIC, "rx"): H,
    (Nic.PE_HOST, "tx"): H, (Nic.PE_CNIC, "rx"): H,  # the H2D
    (Nic.PE_CNIC, "tx"): H + M, (Nic.DE_HOST, "rx"): H + M,
    (Nic.DE_HOST, "tx"): H + M, (Nic.DE_CNIC, "rx"): H + M,
    (Nic.STORAGE, "tx"): H,
}
DESIGN_DE = {
    (Nic.DE_SNIC, "rx"): H,
    (Nic.DE_HOST, "tx"): H + (H + M),  # H to the PE CNIC, then H+M to the DE CNIC
    (Nic.PE_CNIC, "rx"): H,
    (Nic.PE_CNIC, "tx"): M, (Nic.DE_HOST, "rx"): M,
    (Nic.DE_CNIC, "rx"): H + M,
    (Nic.STORAGE, "tx"): H,
}
DESIGN_WRITEBACK = {
    (Nic.DE_CNIC, "tx"): W, (Nic.DE_HOST, "rx"): W, (Nic.DE_SNIC, "tx"): W,
    (Nic.STORAGE, "rx"): W,
}


def full(d: dict) -> dict:
    return {(n, x): d.get((n, x), 0) for n in Nic for x in ("tx", "rx")}


@pytest.mark.parametrize("path,design", [
    ("pe", DESIGN_PE), ("de", DESIGN_DE), ("basic", DESIGN_PE), ("layerwise", DESIGN_PE),
    ("oracle", {}),
])
def test_paths_reproduce_design_table(path, design):
    assert expected_bytes(path, H, M) == full(design)


def test_writeback_reproduces_design_table():
    assert expected_bytes("writeback", W=W) == full(DESIGN_WRITEBACK)
    # the read paths do not depend on W
    assert expected_bytes("pe", H, M, W) == expected_bytes("pe", H, M)


def test_symbolic_table_reads_like_design():
    assert set(table("pe")) == {"PE SNIC rx: H", "PE host port tx: H", "PE CNIC rx: H", "PE CNIC tx: H+M",
                                "DE host port rx: H+M", "DE host port tx: H+M", "DE CNIC rx: H+M",
                                "storage NIC tx: H"}
    assert "DE host port tx: 2H+M" in table("de") and "PE CNIC tx: M" in table("de")


def test_read_path_enum_accepted():
    assert expected_bytes(ReadPath.DE, H, M) == expected_bytes("de", H, M)


@pytest.mark.parametrize("path", list(PATHS))
def test_conservation_per_hop(path):
    """Each hop is counted once as its source's tx and once, equal, as its destination's rx, and
    the per-NIC numbers are nothing but the sum of the hops."""
    R, Rd = 3 * H // 2, H // 5
    vals = dict(H=H, M=M, W=W, Hp=H // 3, Hd=H - H // 3, R=R, Rd=Rd)
    by_hand = {(n, d): 0 for n in Nic for d in ("tx", "rx")}
    for h in hops(path):
        assert h.src != h.dst
        v = h.bytes(**vals)
        assert v > 0
        by_hand[(h.src, "tx")] += v
        by_hand[(h.dst, "rx")] += v
    e = expected_bytes(path, H, M, W, h_pe=H // 3, R=R, Rd=Rd)
    assert e == by_hand
    assert sum(v for (_, d), v in e.items() if d == "tx") == sum(v for (_, d), v in e.items() if d == "rx")


def test_de_path_sends_only_miss_kv_back():
    pe, de = expected_bytes("pe", H, M), expected_bytes("de", H, M)
    assert de[(Nic.PE_CNIC, "tx")] == M and de[(Nic.DE_HOST, "rx")] == M
    assert pe[(Nic.PE_CNIC, "tx")] == H + M
    # hit KV crosses the PE node's DRAM side only on the PE path
    assert de[(Nic.PE_HOST, "tx")] == 0 and de[(Nic.PE_SNIC, "rx")] == 0
    # and the DE path loads the DE host port with one extra read of H
    assert de[(Nic.DE_HOST, "tx")] - pe[(Nic.DE_HOST, "tx")] == H


def test_split_is_pe_part_plus_de_part():
    hp = 300_007
    s = expected_bytes("split", H, M, h_pe=hp)
    pe, de = expected_bytes("pe", hp, M), expected_bytes("de", H - hp, 0)
    assert s == {k: pe[k] + de[k] for k in s}
    assert s[(Nic.DE_CNIC, "rx")] == H + M
    assert expected_bytes("split", H, M, h_pe=H) == expected_bytes("pe", H, M)
    assert expected_bytes("split", H, M, h_pe=0)[(Nic.PE_CNIC, "tx")] == M
    with pytest.raises(ValueError):
        expected_bytes("split", H, M)
    with pytest.raises(ValueError):
        expected_bytes("split", H, M, h_pe=H + 1)


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown path"):
        expected_bytes("gpu-direct", H, M)
    with pytest.raises(ValueError):
        expected_bytes("pe", -1, M)


def test_request_bytes_adds_writeback_except_oracle():
    r = RequestBytes("de", H, M, W, "dpt-p0", "dpt-d0")
    got, want = request_bytes(r), full(DESIGN_DE)
    for k, v in DESIGN_WRITEBACK.items():
        want[k] += v
    assert got == want
    assert all(v == 0 for v in request_bytes(RequestBytes("oracle", H, M, W, "dpt-p0", "dpt-d0")).values())


def test_totals_keyed_by_concrete_nic():
    recs = [
        RequestBytes("pe", H, M, W, "dpt-p0", "dpt-d0"),
        ("de", 2 * H, M, 0, "dpt-p1", "dpt-d0"),
        RequestBytes("de", H, M, W, "dpt-p0", "dpt-d1", pe_engine="dpt-p0e1", de_engine="dpt-d1e0"),
    ]
    t = expected_totals(recs)
    assert t[("dpt-p0", "snic", "rx")] == H
    assert t[("dpt-p1", "snic", "rx")] == 0
    assert t[("dpt-d0", "snic", "rx")] == 2 * H
    assert t[("dpt-d1", "snic", "rx")] == H
    assert t[("dpt-d0", "snic", "tx")] == W and t[("dpt-d1", "snic", "tx")] == W
    assert t[("dpt-d0", "host_port", "tx")] == (H + M) + (2 * 2 * H + M)
    assert t[("dpt-d0", "host_port", "rx")] == (H + M) + M + W
    assert t[("dpt-p0", "cnic", "tx")] == H + M  # request 3's CNIC bytes are on its engine
    assert t[("dpt-p0e1", "cnic", "tx")] == M and t[("dpt-p0e1", "cnic", "rx")] == H
    assert t[("dpt-d1e0", "cnic", "rx")] == H + M and t[("dpt-d1e0", "cnic", "tx")] == W
    assert t[("storage", "storage_nic", "tx")] == 4 * H
    assert t[("storage", "storage_nic", "rx")] == 2 * W
    assert t[("dpt-p0", "host_port", "rx")] == 0  # silent NICs are present, as zeros
    # conservation over the whole run
    assert sum(v for k, v in t.items() if k[2] == "tx") == sum(v for k, v in t.items() if k[2] == "rx")


def test_compare_flags_3_percent_accepts_1_percent():
    exp = expected_totals([RequestBytes("pe", H, M, W, "dpt-p0", "dpt-d0")])
    near = {k: round(v * 1.01) for k, v in exp.items()}
    rows = compare(exp, near)
    assert all(r.ok for r in rows)
    far = dict(near)
    far[("dpt-p0", "snic", "rx")] = round(exp[("dpt-p0", "snic", "rx")] * 0.97)
    rows = compare(exp, far)
    bad = [r for r in rows if not r.ok]
    assert len(bad) == 1 and bad[0].nic == ("dpt-p0", "snic") and bad[0].direction == "rx"
    assert bad[0].ratio == pytest.approx(0.97, abs=1e-6)
    assert "NO" in format_compare(rows)


def test_compare_missing_and_stray_counters():
    exp = {(Nic.PE_SNIC, "rx"): 1000, (Nic.PE_HOST, "rx"): 0}
    rows = {(r.nic, r.direction): r for r in compare(exp, {(Nic.DE_SNIC, "rx"): 50})}
    assert not rows[(Nic.PE_SNIC, "rx")].ok and rows[(Nic.PE_SNIC, "rx")].measured == 0
    assert rows[(Nic.PE_HOST, "rx")].ok and rows[(Nic.PE_HOST, "rx")].ratio == 1.0
    stray = rows[(Nic.DE_SNIC, "rx")]
    assert not stray.ok and stray.expected == 0 and stray.ratio == float("inf")
    assert compare(exp, {(Nic.PE_SNIC, "rx"): 1000, (Nic.DE_SNIC, "rx"): 50}, abs_tolerance=64)[-1].ok


def test_every_node_nic_is_a_fabric_kind():
    assert {n.kind for n in NODE_NICS} == {"snic", "host_port", "cnic"}
    assert Nic.STORAGE.kind == "storage_nic"


def test_rereads_add_their_bytes_on_their_own_hops():
    """A chunked request's later chunks read their past back from the DE buffer (R: DE host
    port to PE CNIC); a decode engine that found a layer not yet landed reads it again (Rd: DE
    host port to DE CNIC). Both come on top of the path's own bytes."""
    R, Rd = 5 * M, 3 * M
    for path in ("pe", "de", "split"):
        h_pe = H // 2 if path == "split" else None
        base = request_bytes(RequestBytes(path, H, M, W, "p0", "d0", h_pe=h_pe))
        more = request_bytes(RequestBytes(path, H, M, W, "p0", "d0", h_pe=h_pe, R=R, Rd=Rd))
        diff = {k: more[k] - base[k] for k in base if more[k] != base[k]}
        assert diff == {(Nic.DE_HOST, "tx"): R + Rd, (Nic.PE_CNIC, "rx"): R, (Nic.DE_CNIC, "rx"): Rd}


def test_a_request_that_moved_no_kv_has_no_interfaces_whatever_its_mode_is_named():
    from dualpath.lifecycle.record import RequestRecord
    from testbed.experiments.results import interfaces_of

    # the isolation experiment's conditions are oracle passes named after the condition
    r = RequestRecord("r0", 0, 0, "qos_on", "none", pe="dpt-p0e0", de="dpt-d0e0", pe_node="dpt-p0", de_node="dpt-d0",
                      hit_bytes=H, miss_bytes=M, writeback_bytes=W)
    assert interfaces_of(r, "qos_on") == {}
    assert interfaces_of(RequestRecord("r1", 0, 0, "basic", "pe", pe="dpt-p0e0", de="dpt-d0e0", pe_node="dpt-p0",
                                       de_node="dpt-d0", hit_bytes=H, miss_bytes=M), "basic")


def test_retransmitted_segments_are_read_from_a_namespaces_snmp_table():
    from testbed.fabric.counters import retransmitted_segments

    snmp = ("Ip: Forwarding DefaultTTL\nIp: 1 64\n"
            "Tcp: RtoAlgorithm RtoMin OutSegs RetransSegs InErrs\nTcp: 1 200 99 17 0\n")
    assert retransmitted_segments(snmp) == 17
    assert retransmitted_segments("Ip: Forwarding\nIp: 1\n") == 0  # no Tcp table: nothing to count, no crash
    assert retransmitted_segments("") == 0  # the namespace's process has exited


def test_another_server_s_tcp_state_is_read_there_in_one_command():
    from testbed.fabric import counters

    snmp = "Tcp: RtoAlgorithm RetransSegs\nTcp: 1 5\n"
    sock = "ESTAB 0 0 10.0.0.1:7000 10.0.0.2:41000 bytes_retrans:3000\n"

    class Remote:  # a fabric whose dpt-d0 is on another server
        calls = []

        def server_of(self, ns):
            return object()

        def run_in(self, ns, argv, root=False):
            self.calls.append((ns, argv))
            return snmp + "--dpt-split--\n" + sock

    fab = Remote()
    got_snmp, got_sock = counters._tcp_state(fab, "dpt-d0")
    assert counters.retransmitted_segments(got_snmp) == 5
    assert counters.parse_ss_resent(got_sock) == {("10.0.0.1", 7000, "10.0.0.2", 41000): 3000}
    assert len(fab.calls) == 1 and fab.calls[0][0] == "dpt-d0"


SS_LINES = (  # `ss -tinHO` in an engine namespace (one socket per line; the second never re-sent)
    "ESTAB 0 0 10.77.0.3:42001 10.77.0.1:51234 bbr wscale:9,9 rto:204 mss:1448 bytes_sent:900000 "
    "bytes_retrans:2896 bytes_acked:890000 segs_out:700 retrans:0/2\n"
    "ESTAB 0 0 10.77.0.3:46000 10.77.0.254:40000 bbr rto:201 bytes_sent:500 bytes_acked:500\n"
    "ESTAB 0 0 [::1]:5000 [::1]:6000 bytes_retrans:10\n")


def test_resent_bytes_are_read_per_ipv4_socket_from_ss():
    from testbed.fabric.counters import parse_ss_resent

    assert parse_ss_resent(SS_LINES) == {("10.77.0.3", 42001, "10.77.0.1", 51234): 2896}
    assert parse_ss_resent("") == {}


def test_a_delta_charges_resent_bytes_to_both_nics_and_first_sent_takes_them_off():
    from testbed.fabric.counters import Snapshot, delta, first_sent

    tx, rx = ("dpt-p0e0", "cnic", "tx"), ("dpt-d0", "host_port", "rx")
    old = ("dpt-p0e0", "10.77.0.3", 42001, "10.77.0.1", 51234)
    new = ("dpt-p0e0", "10.77.0.3", 42002, "10.77.0.1", 51240)
    before = Snapshot(kv_payload={tx: 1000, rx: 1000}, resent_sockets={old: (300, (tx, rx))})
    after = Snapshot(kv_payload={tx: 11_500, rx: 11_400},
                     resent_sockets={old: (500, (tx, rx)), new: (100, (tx,))})  # new: opened since
    d = delta(after, before)
    assert d.kv_resent == {tx: 200 + 100, rx: 200}
    assert first_sent(d) == {tx: 10_500 - 300, rx: 10_400 - 200}
