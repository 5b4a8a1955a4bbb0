"""The Mooncake transport behind Agent's interface (dualpath/transport/mooncake.py), on loopback:
byte-exact READs and WRITEs of descriptor lists, notifications after the data, its ports inside
the kv range (the class nftables marks), and bad input refused in one line. No root needed."""
from __future__ import annotations

import importlib.util

import numpy as np
import psutil
import pytest

from dualpath.traffic_classes import KV_PORT_RANGE
from dualpath.transport import TransferFailed, TransportError
from dualpath.transport.base import Region

from dualpath.transport.mooncake import MooncakeAgent, iface_ipv4  # noqa: E402

# find_spec, not an import: Mooncake reads its port range when its engine module loads
pytestmark = pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                                reason="the Mooncake wheel is not installed")

MB = 1 << 20
BEFORE: set[int] = set()


def _listening() -> set[int]:
    return {c.laddr.port for c in psutil.Process().net_connections(kind="tcp") if c.status == "LISTEN"}


@pytest.fixture(scope="module")
def pair():
    global BEFORE
    BEFORE = _listening()  # what else in this process listens (other tests' agents)
    a, b = MooncakeAgent("mc-a", "lo", timeout_s=20), MooncakeAgent("mc-b", "lo", timeout_s=20)
    hbm = np.zeros(2 * MB, np.uint8)
    buf = np.random.default_rng(7).integers(0, 256, 2 * MB, dtype=np.uint8)
    a.register("hbm", hbm, "hbm")
    b.register("buf", buf)
    assert a.add_peer(b.metadata()) == "mc-b" and b.add_peer(a.metadata()) == "mc-a"
    a.connect("mc-b")
    yield a, b, hbm, buf
    a.close()
    b.close()


def test_read_and_write_are_byte_exact_with_notifications_after_them(pair):
    a, b, hbm, buf = pair
    descs = [(0, 4096, 8192), (8192, MB, 65536), (MB, 3, 100_001)]  # odd lengths and offsets too
    st = a.read("mc-b", "hbm", "buf", descs, notif="req1/L0", layer=0)
    assert (st.op, st.nbytes, st.ndesc, st.traffic_class) == ("READ", 8192 + 65536 + 100_001, 3, "kv")
    for lo, ro, n in descs:
        assert np.array_equal(hbm[lo:lo + n], buf[ro:ro + n])
    assert b.wait_notif("mc-a", "req1/L0", timeout=10) == b"req1/L0"

    hbm[:] = np.arange(hbm.size, dtype=np.uint64).astype(np.uint8)[::-1]
    xfer = a.post("WRITE", "mc-b", "hbm", "buf", [(0, 0, MB)], notif="req1/L1", layer=1)
    xfer.wait()
    b.wait_notif("mc-a", "req1/L1", timeout=10)
    ok = False
    for _ in range(200):  # a WRITE completes when its bytes left the sender: they land soon after
        ok = np.array_equal(buf[:MB], hbm[:MB])
        if ok:
            break
        import time
        time.sleep(0.01)
    assert ok
    assert a.moved["READ"] >= st.nbytes and a.moved["WRITE"] >= MB


def test_a_list_is_done_only_when_its_last_descriptor_is(pair):
    """The wheel's status call reads a batch's first task only: a tiny first descriptor before a
    large one would report the whole list done while the large one is still moving."""
    a, _, hbm, buf = pair
    hbm[:] = 0
    a.read("mc-b", "hbm", "buf", [(0, 0, 1), (4096, 4096, 2 * MB - 4096)])
    assert hbm[0] == buf[0] and np.array_equal(hbm[4096:], buf[4096:])  # at once, no waiting


def test_every_listening_port_is_in_the_kv_range(pair):
    """nftables marks the kv class by port: a Mooncake port outside the range would carry KV in
    the model class (Mooncake's own default, 15000-17000, is outside it)."""
    listening = sorted(_listening() - BEFORE)
    assert len(listening) >= 4  # each engine: its RPC (handshake) port and its data port
    lo, hi = KV_PORT_RANGE
    assert all(lo <= p <= hi for p in listening), listening


def test_failures_are_named(pair):
    a, b, hbm, _ = pair
    forged = Region("buf", "dram", 4096, 4096)  # an address the peer never registered
    with pytest.raises(TransferFailed, match="failed in Mooncake"):
        a.post("READ", "mc-b", "hbm", forged, [(0, 0, 4096)]).wait(10)
    with pytest.raises(TransportError, match="runs past remote region"):
        a.post("READ", "mc-b", "hbm", "buf", [(0, 2 * MB - 10, 11)])
    with pytest.raises(TransportError, match="unknown peer"):
        a.post("READ", "nobody", "hbm", "buf", [(0, 0, 1)])
    with pytest.raises(TransportError, match="has no region"):
        a.post("READ", "mc-b", "hbm", "nothing", [(0, 0, 1)])
    with pytest.raises(TransportError, match="unknown mode 'each'"):
        a.post("READ", "mc-b", "hbm", "buf", [(0, 0, 1)], mode="each")
    with pytest.raises(TransportError, match="refusing to mix"):
        import msgpack
        a.add_peer(msgpack.packb({"v": 1, "name": "nixl-peer", "transport": "tcp", "class": "kv", "regions": {}}))


def test_bad_settings_are_refused_before_anything_starts(pair):
    with pytest.raises(TransportError, match="kv class only"):
        MooncakeAgent("mc-model", "lo", "model")
    with pytest.raises(TransportError, match="not inside the kv range"):
        MooncakeAgent("mc-out", "lo", port_range=(15000, 17000))
    with pytest.raises(TransportError, match="once per process"):
        MooncakeAgent("mc-sub", "lo", port_range=(KV_PORT_RANGE[0], KV_PORT_RANGE[0] + 99))
    with pytest.raises(TransportError, match="no IPv4 address"):
        MooncakeAgent("mc-noif", "dpt-no-such-if")
    assert iface_ipv4("lo") == "127.0.0.1"
