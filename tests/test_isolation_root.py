"""The collectives' traffic is in the model class on the wire, on a live small fabric (root).

An engine namespace runs the group's AllToAll against its peer's responder, beside a saturating
kv-class load; HTB's class counters on both CNICs and nftables' DSCP counters in both namespaces
must put the collective's bytes in the model class (DSCP 46) and the load's in the kv class, with
QoS on, and nftables must still tell them apart with QoS off (one FIFO). Then the engines of a
short end-to-end run with `collectives: on` run one collective per layer of every pass and step.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from dualpath.nodes.common import collective_port
from dualpath.traffic_classes import KV, MODEL
from emulators.nic import class_for
from testbed.cluster.processes import CONTROL_PORT
from testbed.fabric.counters import class_bytes, dscp_counters
from testbed.fabric.network import Fabric
from testbed.experiments.kvload import KvLoad
from testbed.fabric.shell import ns_argv
from testbed.topology import load_topology
from tests.conftest import REPO, needs_root, own_the_machine

pytestmark = needs_root
TOPO = REPO / "topologies" / "1p1d-isolation.yaml"
TOKENS, ROUNDS = 200, 15
CLIENT = """
import json, sys
from dualpath.engines.collective import CollectiveConfig, CollectiveGroup
g = CollectiveGroup(CollectiveConfig.from_dict(json.loads(sys.argv[1])))
recs = [g.run(int(sys.argv[2])) for _ in range(int(sys.argv[3]))]
print(json.dumps({"sent": sum(r.sent for r in recs), "received": sum(r.received for r in recs),
                  "p50": sorted(r.latency_s for r in recs)[len(recs) // 2]}))
"""


def _collectives(fab: Fabric, a: str, b: str) -> dict:
    """ROUNDS collectives of TOKENS tokens from engine a against b's responder."""
    cfg = {"port": collective_port(CONTROL_PORT), "peers": [fab.endpoint(b).ip],
           "dispatch_per_token": 2733.0, "combine_per_token": 5301.0}
    out = subprocess.run(ns_argv(a, [sys.executable, "-c", CLIENT, json.dumps(cfg), str(TOKENS), str(ROUNDS)]),
                         capture_output=True, text=True, timeout=60, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def _htb(fab: Fabric, eng: str, qos: bool) -> dict[str, int]:
    nic = fab.endpoint(eng).nic("cnic")
    got = class_bytes(nic.bridge_dev)  # what the engine received
    return {tc.name: got.get(class_for(qos, tc), 0) for tc in (MODEL, KV)}


# class scope: the fabric must be down before the end-to-end test below, whose no_leftovers would
# otherwise clean it away underneath its owner (mininet's stop then waits on dead shells forever)
@pytest.fixture(scope="class")
def fabric():
    from testbed.fabric.cleanup import find_leftovers

    own_the_machine()
    with Fabric(load_topology(TOPO)) as fab:
        a, b = "dpt-p0e0", "dpt-p0e1"
        resp = subprocess.Popen(ns_argv(b, [sys.executable, "-m", "dualpath.nodes.collective_peer", "--ip",
                                            fab.endpoint(b).ip, "--port", str(collective_port(CONTROL_PORT))]),
                                stdout=subprocess.PIPE, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
        try:
            assert resp.stdout.readline().startswith(b"listening")
            yield fab, a, b
        finally:
            resp.kill()
            resp.wait(5)
    assert find_leftovers().empty()


class TestOnTheWire:
    @pytest.mark.parametrize("qos", [True, False])
    def test_collective_bytes_are_in_the_model_class_beside_a_kv_load(self, fabric, qos):
        fab, a, b = fabric
        fab.apply_shaping(qos)
        with KvLoad(fab, [fab.endpoint(a), fab.endpoint(b)]) as load:
            time.sleep(1.0)
            h0 = {e: _htb(fab, e, qos) for e in (a, b)}
            n0 = dscp_counters(fab)
            res = _collectives(fab, a, b)
            n1 = dscp_counters(fab)
            h1 = {e: _htb(fab, e, qos) for e in (a, b)}
            assert load.alive() == [a, b]
        fab.apply_shaping(True)
        assert res["sent"] == ROUNDS * round(TOKENS * 2733.0) and res["received"] == ROUNDS * round(TOKENS * 5301.0)
        nft = {e: {c: n1[e][c][0] - n0[e][c][0] for c in ("model", "kv")} for e in (a, b)}
        # nftables, by the DS field as each namespace sent it: the dispatch from a, the combine from b
        assert res["sent"] <= nft[a]["model"] < 1.05 * res["sent"] + 64_000
        assert res["received"] <= nft[b]["model"] < 1.05 * res["received"] + 64_000
        # the kv load's bytes came from the host namespaces, marked AF11 by port; the engines sent
        # only its ACKs in the kv class
        host = fab.endpoint(a).node
        assert nft[a]["kv"] < 0.05 * (n1[host]["kv"][0] - n0[host]["kv"][0])
        assert n1[host]["kv"][0] - n0[host]["kv"][0] > 10 << 20
        if qos:  # HTB classified the same bytes the same way on the receiving CNICs
            got = {e: {c: h1[e][c] - h0[e][c] for c in ("model", "kv")} for e in (a, b)}
            assert got[b]["model"] >= res["sent"] and got[a]["model"] >= res["received"]
            assert got[b]["kv"] > 10 << 20 and got[a]["kv"] > 10 << 20  # the load, in the kv class


def test_engines_run_one_collective_per_layer_of_every_pass_and_step(tmp_path, no_leftovers):
    from dualpath.model.tiny import DEMO, make_tiny_checkpoint
    from dualpath.workload import demo_workload, generate
    from testbed.experiments.ablation import run_e2e, run_geometry
    from testbed.experiments.results import summarize

    ckpt = make_tiny_checkpoint(tmp_path / "ck", seed=0, kind="qwen2", **DEMO)
    wl = generate(demo_workload(seed=1, n_trajectories=2, turns_mean=2.0, turns_min=2))
    topo = load_topology(TOPO)
    with Fabric(topo) as fab:
        results = run_e2e(fab, wl, ckpt, tmp_path / "run", modes=("oracle",), progress=lambda _m: None)
    s = summarize(results, wl, run_geometry(ckpt), topo)["modes"]["oracle"]
    res = results[0]
    n_layer = DEMO["num_hidden_layers"]
    assert s["errors"] == 0
    c = s["collectives"]
    assert c["prefill"]["count"] == n_layer * len(res.batches)
    assert c["decode"]["count"] == n_layer * len(res.steps)
    assert c["latency_s"]["p50"] > 0 and c["sent_bytes"] > 0
    # every collective byte left its sender marked EF (control is unmarked and not in it)
    assert c["sent_bytes"] + c["received_bytes"] <= c["model_class_tx_bytes"]
    assert c["model_class_tx_bytes"] < 1.1 * (c["sent_bytes"] + c["received_bytes"]) + 1_000_000
    # a pass lasts at least its compute windows plus what it waited for its collectives
    for b in res.batches:
        tm = b["timing"]
        assert tm["collectives"] == n_layer and b["t_end"] - b["t_start"] >= tm["held_s"] + tm["collective_s"] - 1e-3
