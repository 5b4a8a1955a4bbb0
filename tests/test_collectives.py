"""The model-class collectives: their sizing from the target, their wire exchange (over loopback),
and how passes and steps fold their time into the emulated clock. No root needed."""
import math
import threading

import numpy as np
import pytest
import torch

from dualpath.engines.clock import DeviceClock
from dualpath.engines.collective import (CollectiveConfig, CollectiveGroup, CollectiveRecord, Responder,
                                         split_evenly)
from dualpath.engines.decode import DecodeBatcher, DecodeJob
from dualpath.engines.prefill import prefill_batch
from dualpath.kv.buffers import ByteAllocator
from dualpath.kv.decode_connector import DecodePlan, OracleDecodeConnector
from dualpath.kv.layouts import BlockGeometry
from dualpath.model import Transformer
from dualpath.model.tiny import DEMO, make_tiny_checkpoint
from dualpath.traffic_classes import MODEL
from emulators import dscp_marking
from emulators.gpu.collectives import NoCollective, collective_traffic, expected_remote_nodes
from emulators.gpu.cost import dilation
from emulators.gpu.models import MODELS
from testbed.measure.collectives import collective_rows, collective_stats
from testbed.topology import TopologyError, load_topology, parse_topology
from tests.conftest import REPO
from tests.test_emulated_time import DECODE, K, PREFILL, VirtualTime, _oracle_items

TOPOLOGIES = REPO / "topologies"


# --------------------------------------------------------------------------- sizing (pure)


def test_expected_remote_nodes():
    # two nodes, 256 experts, top-8: the token misses the other node only if all 8 are local
    assert expected_remote_nodes(256, 8, 2) == pytest.approx(1 - math.comb(128, 8) / math.comb(256, 8))
    assert expected_remote_nodes(256, 8, 1) == 0.0
    assert expected_remote_nodes(8, 8, 4) == pytest.approx(3.0)  # every expert elsewhere too: all nodes hit
    with pytest.raises(ValueError):
        expected_remote_nodes(10, 2, 3)  # 10 experts do not spread over 3 nodes


def test_the_ds660b_alltoall_counts_deepeps_internode_bytes():
    m = MODELS["deepseek-v3.2"]
    c = collective_traffic(m)
    remote = expected_remote_nodes(256, 8, 2)
    assert (c.kind, c.ep, c.nodes, c.moe_layers) == ("alltoall", 16, 2, 58)
    assert c.dispatch_bytes == pytest.approx((7168 + 7168 // 128 * 4) * remote)  # FP8 + FP32 scales
    assert c.combine_bytes == pytest.approx(7168 * 2 * remote)  # BF16
    assert c.bytes_per_token == pytest.approx((c.dispatch_bytes + c.combine_bytes) * 58)
    assert 30 < c.bytes_per_token / m.kv_bytes_per_token < 33  # about 31x its KV per token


def test_models_without_cnic_collectives_say_why():
    with pytest.raises(NoCollective, match="data-parallel"):
        collective_traffic(MODELS["qwen2.5-32b"])
    with pytest.raises(NoCollective, match="NVLink"):
        collective_traffic(MODELS["ds-27b"])  # EP 8 fits one node


def test_scaled_like_kv_a_collective_lasts_the_dilation_times_the_targets():
    m = MODELS["deepseek-v3.2"]
    c = collective_traffic(m)
    tb_kv, layers, scale = 2048, 8, 0.0025
    d, comb = c.per_testbed_layer(tb_kv, m.kv_bytes_per_token, layers)
    # all layers together carry the target's bytes per token times the KV ratio
    assert (d + comb) * layers == pytest.approx(c.bytes_per_token * tb_kv / m.kv_bytes_per_token)
    target_rate = 50e9  # a 400 Gbit/s CNIC, bytes/s
    target_s = c.bytes_per_token / target_rate
    testbed_s = (d + comb) * layers / (target_rate * scale)
    assert testbed_s == pytest.approx(dilation(tb_kv, m.kv_bytes_per_token, scale) * target_s)


def test_per_peer_sizes_split_the_layer_evenly():
    assert split_evenly(10, 3) == [4, 3, 3] and sum(split_evenly(7, 7)) == 7 and split_evenly(5, 0) == []
    cfg = CollectiveConfig(5559, ("10.0.0.2", "10.0.0.3"), dispatch_per_token=100.5, combine_per_token=201)
    sizes = cfg.sizes(3)
    assert sum(a for a, _ in sizes) == round(3 * 100.5) and sum(b for _, b in sizes) == 603
    assert CollectiveConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.tos == MODEL.tos_byte == 46 << 2
    with pytest.raises(ValueError):
        CollectiveConfig(0, (), 1, 1)


# --------------------------------------------------------------------------- topology switch


def test_shipped_topologies_run_no_collectives_and_the_isolation_one_does():
    for path in TOPOLOGIES.glob("*.yaml"):
        t = load_topology(path)
        assert t.spec.collectives == (t.name == "1p1d-isolation"), path.name
    assert "collectives on (alltoall" in load_topology(TOPOLOGIES / "1p1d-isolation.yaml").describe()[2]


def test_collectives_on_a_data_parallel_target_is_a_one_line_error():
    import yaml

    raw = yaml.safe_load((TOPOLOGIES / "1p1d.yaml").read_text())
    with pytest.raises(TopologyError) as e:
        parse_topology({**raw, "collectives": True}, source="t.yaml")
    msg = str(e.value)
    assert "\n" not in msg and "field 'collectives'" in msg and "data-parallel" in msg and "fix:" in msg
    lone = {**raw, "collectives": True, "engines_per_node": 1, "target": {"gpu": "h800", "model": "deepseek-v3.2"},
            "dram_gbps": 1000}
    with pytest.raises(TopologyError, match="no engine group has two engines"):
        parse_topology(lone, source="t.yaml")


def test_groups_and_peers_of_a_fabric_plan():
    from testbed.cluster.processes import collective_configs
    from testbed.fabric.network import engine_groups, plan

    eps = plan(load_topology(TOPOLOGIES / "2p1d.yaml"))
    groups = engine_groups(eps)
    assert [e.name for e in groups["pe"]] == ["dpt-p0e0", "dpt-p0e1", "dpt-p1e0", "dpt-p1e1"]
    assert [e.name for e in groups["de-dpt-d0"]] == ["dpt-d0e0", "dpt-d0e1"]
    cfgs = collective_configs(eps, {"dispatch_per_token": 2.0, "combine_per_token": 4.0})
    ip = {e.name: e.ip for e in eps}
    assert sorted(cfgs["dpt-p0e0"]["peers"]) == sorted(ip[n] for n in ("dpt-p0e1", "dpt-p1e0", "dpt-p1e1"))
    assert cfgs["dpt-d0e1"]["peers"] == [ip["dpt-d0e0"]]
    assert len({c["port"] for c in cfgs.values()}) == 1


# --------------------------------------------------------------------------- the wire (loopback)


@pytest.fixture
def responders():
    """Responders on 127.0.0.2 and 127.0.0.3 (both loopback), one port, in threads."""
    made = []
    port = None
    for ip in ("127.0.0.2", "127.0.0.3"):
        for cand in range(25_590, 25_690):
            r = Responder(ip, cand if port is None else port)
            try:
                sock = r.listen()
            except OSError:
                if port is not None:
                    pytest.skip("no free loopback port for the responders")
                continue
            port = r.port
            break
        th = threading.Thread(target=r.serve, args=(sock,), daemon=True)
        th.start()
        made.append((r, th))
    yield port
    for r, th in made:
        r.stop.set()
        th.join(timeout=3)


def test_a_collective_sends_and_receives_exactly_its_sizes(responders):
    cfg = CollectiveConfig(responders, ("127.0.0.2", "127.0.0.3"), dispatch_per_token=3000.0,
                           combine_per_token=5000.5)
    g = CollectiveGroup(cfg)
    try:
        for n in (1, 37, 700):  # 700 tokens: 3.5 MB back, several chunks per peer
            rec = g.run(n)
            assert rec.sent == round(n * 3000.0) and rec.received == round(n * 5000.5)
            assert rec.latency_s > 0 and rec.tokens == n
        assert g.run(0).latency_s == 0  # nothing to route: nothing moves
        log = g.take_log()
        assert [r["tokens"] for r in log] == [1, 37, 700] and g.take_log() == []
    finally:
        g.close()


def test_a_missing_responder_is_a_clear_error(monkeypatch):
    import dualpath.engines.collective as coll

    monkeypatch.setattr(coll, "CONNECT_TIMEOUT_S", 0.2)
    g = CollectiveGroup(CollectiveConfig(9, ("127.0.0.9",), 1.0, 1.0))
    with pytest.raises(RuntimeError, match="no responder at 127.0.0.9:9"):
        g.run(4)


# --------------------------------------------------------------------------- the clock


class FakeCollective:
    """Takes `s` virtual seconds per call; records like CollectiveGroup."""

    def __init__(self, vt: VirtualTime, s: float) -> None:
        self.vt, self.s, self.log, self.calls = vt, s, [], []

    def run(self, n: int) -> CollectiveRecord:
        t0 = self.vt.t
        self.vt.t += self.s
        self.calls.append(n)
        self.log.append(CollectiveRecord(t0, self.s, n, n, 2 * n))
        return self.log[-1]

    def take_log(self) -> list[dict]:
        out, self.log = self.log, []
        return [r.to_dict() for r in out]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Transformer:
    torch.set_num_threads(1)
    return Transformer.from_pretrained(make_tiny_checkpoint(tmp_path_factory.mktemp("ck"), seed=0, **DEMO))


@pytest.fixture(scope="module")
def geom(model) -> BlockGeometry:
    return BlockGeometry.from_config(model.config, block_size=16)


def test_a_pass_waits_for_every_layers_collective_and_it_is_not_lateness(model, geom):
    vt = VirtualTime()
    clock = DeviceClock(K, now=vt.now, sleep=vt.sleep)
    coll = FakeCollective(vt, 0.004)
    batch = [(0, 40), (300, 17)]
    t0 = vt.t
    _, timing = prefill_batch(model, _oracle_items(model, geom, batch), clock, PREFILL, coll)
    n_layer = model.config.n_layer
    assert coll.calls == [57] * n_layer  # every layer routes the batch's new tokens
    assert vt.t - t0 == pytest.approx(PREFILL.predict(batch) * K + n_layer * 0.004)
    assert timing.collectives == n_layer and timing.collective_s == pytest.approx(n_layer * 0.004)
    assert timing.late_s == 0 and not timing.overran


def test_a_decode_step_is_its_windows_and_its_collectives(model, geom):
    vt = VirtualTime()
    clock = DeviceClock(K, now=vt.now, sleep=vt.sleep)  # only the step's thread moves it meanwhile
    coll = FakeCollective(vt, 0.002)
    b = DecodeBatcher(model, geom, clock, DECODE, coll)
    hbm = np.zeros(1, dtype=np.uint8)
    alloc = ByteAllocator(1 << 20, "hbm")
    for name, n, g in (("a", 20, 4), ("b", 33, 3)):
        b.admit(DecodeJob(DecodePlan(name, n, g, n // 16, None, None), first_token=7, t_first_token=vt.t,
                          conn=OracleDecodeConnector(None, hbm, alloc, geom)))
    import os
    import select

    done = []
    for _ in range(200):
        done += b.poll()
        if b.idle:
            break
        if b.wants_step():
            b.begin_step()
        elif b._step is not None and b._step.done is not None:
            select.select([b.wake_fd], [], [], 5)  # the step's thread ends it
            os.read(b.wake_fd, 64)
    assert sorted(j.plan.request for j in done) == ["a", "b"]
    n_layer = model.config.n_layer
    steps = b.step_log
    assert [s["n"] for s in steps] == [2, 2, 1]
    assert all(s["collectives"] == n_layer and len(s["collective_log"]) == n_layer for s in steps)
    assert steps[0]["t_end"] - steps[0]["t_start"] == pytest.approx(DECODE.step_cost([21, 34]) * K + n_layer * 0.002)
    assert not any(s["overran"] for s in steps)


def test_collective_stats_of_passes_and_steps():
    passes = [{"pe": "p", "timing": {"collective_log": [{"t": 0, "s": 0.01, "tokens": 5, "sent": 10, "received": 20}] * 4}}]
    steps = [{"de": "d", "collective_log": [{"t": 0, "s": 0.002, "tokens": 1, "sent": 2, "received": 4}] * 6},
             {"de": "d"}]
    rows = collective_rows(passes, steps)
    assert [r["role"] for r in rows].count("prefill") == 4 and len(rows) == 10
    st = collective_stats(passes, steps, dilation=2.0)
    assert st["count"] == 10 and st["sent_bytes"] == 52 and st["received_bytes"] == 104
    assert st["prefill"]["latency_s"]["p50"] == pytest.approx(0.005)  # emulated: testbed / dilation
    assert st["decode"]["latency_s"]["testbed_s"]["p99"] == pytest.approx(0.002)
    assert collective_stats([{"timing": {}}], [], 1.0) is None


def test_nft_counts_each_class_by_its_dscp():
    script = dscp_marking.nft_script()
    assert "ip dscp 46 counter name \"model_tx\"" in script and "ip dscp 10 counter name \"kv_tx\"" in script
    text = ('{"nftables": [{"metainfo": {}}, {"counter": {"family": "ip", "name": "model_tx", "table": "dpt_qos", '
            '"packets": 3, "bytes": 900}}, {"counter": {"family": "ip", "name": "kv_tx", "table": "dpt_qos", '
            '"packets": 1, "bytes": 10}}]}')
    assert dscp_marking.parse_counters(text) == {"model": (900, 3), "kv": (10, 1)}
    assert dscp_marking.parse_counters(text, received=True) == {"model": (0, 0), "kv": (0, 0)}
    # what arrives is counted at prerouting, apart from what is sent
    assert "hook prerouting" in script and "ip dscp 46 counter name \"model_rx\"" in script
    rx = text.replace('"model_tx"', '"model_rx"')
    assert dscp_marking.parse_counters(rx, received=True) == {"model": (900, 3), "kv": (0, 0)}
    assert dscp_marking.parse_counters(rx)["model"] == (0, 0)
