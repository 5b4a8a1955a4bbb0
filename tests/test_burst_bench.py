"""`dualpath bench burst` on a live 1p1d-io: fresh transfers through each shaped NIC kind, timed.

The bands are loose enough for a noisy machine and far tighter than any broken measurement: an
unshaped veth would move the transfer about a hundred times faster than its NIC's rate, a
transfer timed from the wrong end or a wrong rate would be off by its whole length, and HTB's
burst beyond its bucket is a few segments (stop 34 measured 8-18 KB of payload, 15 transfers
per kind).
"""
import pytest

from testbed.calibrate.benches import burst
from testbed.fabric.network import Fabric
from testbed.topology import load_topology
from tests.conftest import REPO, needs_root, own_the_machine

pytestmark = needs_root


def test_fresh_transfers_leave_near_the_bucket_model_on_every_nic_kind(monkeypatch):
    from testbed.fabric.cleanup import find_leftovers

    own_the_machine()
    monkeypatch.setattr(burst, "REPEATS", 3)
    monkeypatch.setattr(burst, "IDLE_S", 0.5)
    topo = load_topology(REPO / "topologies" / "1p1d-io.yaml")
    with Fabric(topo) as fab:
        res = burst.bench_burst(fab, topo.spec.mtu, progress=lambda _m: None)
    assert find_leftovers().empty()
    assert set(res["kinds"]) == {"snic", "cnic", "host_port"}
    for kind, k in res["kinds"].items():
        assert len(k["seconds"]) == 3, kind
        model = k["bucket_model_s"]
        assert model > 0.1, kind  # 0.2 s of line rate, less one bucket
        for t in k["seconds"]:
            assert 0.8 * model <= t <= 1.25 * model + 0.02, (kind, t, model)
        # what the simulator takes: a few segments beyond the bucket at most; below 0 only by
        # the timing's noise (10 ms of the NIC's rate: a late scheduled receiver)
        assert -k["rate_bps"] * 0.01 / 8 < k["mean_extra_payload_bytes"] < 256 * 1024, (kind, k)
    assert "beyond the bucket" in "\n".join(burst.burst_lines(res))
