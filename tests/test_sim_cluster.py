"""The simulator's cluster (simulator/cluster.py, network.py) and its testbed glue (testbed/sim/drive.py):
the lazy flow network against the reference flow model, hand-solved cases, and whole runs that
must keep the testbed's invariants."""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

import dualpath.scheduler.core as core
from dualpath.traffic_classes import KV, MODEL
from simulator import cluster as sim_cluster
from simulator import parts as sim_parts
from simulator.calibration import UNCALIBRATED, Calibration
from simulator.flows import Flow, FlowNetwork, Link
from simulator.network import FastFlowNetwork
from testbed.sim.drive import sim_config, simulate, summarize, trajectories
from testbed.topology import load_topology
from dualpath.workload import demo_workload
from tests.test_sim_flows import networks

B = 8
ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- the lazy network


def test_two_flows_on_one_link_share_it_and_the_survivor_takes_it_all():
    link = Link("l", 1000 * B)
    n = FastFlowNetwork()
    a = n.start([link], 1000)
    b = n.start([link], 500)
    assert n.rates() == {a.id: 500 * B, b.id: 500 * B}
    done = n.advance_to(10)
    # b ends at 1 s (500 B at 500 B/s); a has 500 B left, alone at 1000 B/s: 1.5 s
    assert [(f.id, f.finish) for f in done] == [(b.id, 1.0), (a.id, 1.5)]


def test_priority_class_takes_its_share_of_a_qos_link_against_best_effort():
    link = Link("l", 255 * B, qos=True)
    n = FastFlowNetwork()
    m = n.start([link], 1e6, MODEL.name)
    k = n.start([link], 1e6, KV.name)
    r = n.rates()
    assert r[m.id] == pytest.approx(240 * B, rel=1e-12) and r[k.id] == pytest.approx(15 * B, rel=1e-12)


def test_three_hop_path_runs_at_its_narrowest_hop_and_a_cross_flow_shares_only_that_hop():
    a, mid, c = Link("a", 300 * B), Link("mid", 100 * B), Link("c", 300 * B)
    n = FastFlowNetwork()
    f = n.start([a, mid, c], 100)
    assert n.rates() == {f.id: 100 * B}
    g = n.start([mid], 50)
    assert n.rates() == {f.id: 50 * B, g.id: 50 * B}
    # g ends at 1 s; f has 50 B left at 100 B/s: 1.5 s
    assert [(x.id, x.finish) for x in n.advance_to(5)] == [(g.id, 1.0), (f.id, 1.5)]


def test_a_slack_host_port_binds_nothing():
    # g flows each through its own B compute NIC into one g*B host port: every flow gets B
    port = Link("port", 4 * 100 * B)
    n = FastFlowNetwork()
    fs = [n.start([Link(f"cnic{i}", 100 * B), port], 100) for i in range(4)]
    assert set(n.rates().values()) == {100 * B}
    assert [x.finish for x in n.advance_to(2)] == [1.0] * 4
    assert n.delivered[port] == 400 and all(f.done for f in fs)


@settings(max_examples=150, deadline=None)
@given(networks())
def test_lazy_network_completes_every_flow_when_the_reference_model_does(net):
    _, flows = net
    ref = FlowNetwork()
    for f in flows:
        ref.add(Flow(f.id, f.path, f.bytes, f.traffic_class, f.start))
    want = ref.run()
    fast = FastFlowNetwork()
    got: dict = {}
    for f in sorted(flows, key=lambda f: f.start):
        for d in fast.advance_to(f.start):
            got[d.id] = d.finish
        x = fast.start(f.path, f.bytes, f.traffic_class, id=f.id)
        if x.done:
            got[x.id] = x.finish
    for d in fast.advance_to(1e9):
        got[d.id] = d.finish
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-9), k


# --------------------------------------------------------------------------- whole runs


def _setup(n_traj=4, topo="1p1d-io", cal=UNCALIBRATED, aps=None):
    t = load_topology(ROOT / "topologies" / f"{topo}.yaml")
    cfg = sim_config(t, cal=cal)
    w = demo_workload(n_trajectories=n_traj)
    return t, cfg, w, trajectories(w, cfg.dilation, aps=aps)


def test_the_sim_runs_the_scheduler_core_itself():
    assert sim_cluster.Scheduler is core.Scheduler
    assert "class Scheduler" not in inspect.getsource(sim_cluster)
    _, cfg, _, trajs = _setup(1)
    sim = sim_cluster.ClusterSim(cfg, "dualpath", "layerwise", "shorter", trajs)
    assert type(sim.sched) is core.Scheduler


def test_a_small_run_finishes_every_request_deterministically_with_the_summary_keys():
    topo, cfg, w, trajs = _setup(4)
    modes = ["basic", "dualpath", "oracle"]
    a = simulate(cfg, trajs, modes)
    b = simulate(cfg, trajs, modes)
    n_turns = sum(len(t.turns) for t in trajs)
    for m in modes:
        assert len(a[m].records) == n_turns
        assert [r.token_times for r in a[m].records] == [r.token_times for r in b[m].records]
        assert a[m].jct_s == b[m].jct_s
    s = summarize(a, cfg, topo, w, "testbed")
    for m in modes:
        v = s["modes"][m]
        assert {"jct_s", "ttft_s", "tpot_s", "snic_max_over_avg"} <= v.keys()
        assert v["errors"] == 0 and v["ttft_s"]["p50"] > 0
    assert s["modes"]["oracle"]["jct_s"] < s["modes"]["dualpath"]["jct_s"] < s["modes"]["basic"]["jct_s"]


def test_the_sim_and_the_conductor_keep_one_request_record():
    from dualpath.lifecycle.record import RequestRecord
    from testbed.cluster import conductor

    assert sim_cluster.RequestRecord is RequestRecord is conductor.RequestRecord
    for module in (sim_cluster, conductor):
        assert "Record:" not in "".join(l for l in inspect.getsource(module).splitlines(True) if l.startswith("class "))
    _, cfg, _, trajs = _setup(1)
    rec = simulate(cfg, trajs, ["dualpath"])["dualpath"].records[0]
    assert type(rec) is RequestRecord and rec.path in ("pe", "de") and rec.token_times
    assert "prompt" not in rec.to_json() and rec.to_json()["request"] == rec.request


def test_bytes_read_are_the_hits_and_go_where_the_path_says():
    topo, cfg, w, trajs = _setup(4)
    res = simulate(cfg, trajs, ["basic", "dualpath", "oracle"])
    kvb = cfg.kv_bytes_per_token
    fbb = cfg.full_block_bytes
    for m in ("basic", "dualpath"):
        snic = {k: v for k, v in res[m].link_bytes.items() if k.endswith("/snic/rx")}
        hit = sum(r.n_hit for r in res[m].records) * kvb
        assert sum(snic.values()) == pytest.approx(hit, rel=1e-9)
        wb = sum(r.writeback_bytes for r in res[m].records)
        tx = sum(v for k, v in res[m].link_bytes.items() if k.endswith("/snic/tx"))
        assert tx == pytest.approx(wb, rel=1e-9) and wb % fbb == 0
    basic = res["basic"].link_bytes
    assert basic.get("dpt-d0/snic/rx", 0) == 0 and basic["dpt-p0/snic/rx"] > 0  # basic reads on the PE side
    assert res["dualpath"].link_bytes.get("dpt-d0/snic/rx", 0) > 0
    assert not any(v for k, v in res["oracle"].link_bytes.items())  # oracle moves nothing


def test_a_lone_request_decodes_at_the_cost_models_step_times():
    topo, cfg, w, trajs = _setup(1)
    trajs = [sim_cluster.TrajectorySpec(0, 512, [(24, 6)])]
    r = simulate(cfg, trajs, ["oracle"])["oracle"].records[0]
    ctx = r.n_prompt + 1
    for i, (t0, t1) in enumerate(zip(r.token_times[1:], r.token_times[2:])):
        assert t1 - t0 == pytest.approx(cfg.decode_cost.step_cost([ctx + i + 1]) * cfg.dilation, rel=1e-9)


def test_under_dsa_every_step_costs_what_the_cost_model_says_before_and_after_a_context_reaches_the_cap():
    """DSA's main attention reads at most context_cap keys: the step cost's slope drops when a
    context reaches it, and a closed-form segment must end there (two requests cross at different
    steps, one of them already past the cap at its first step)."""
    from dataclasses import replace
    from dualpath.scheduler.cost_model import DecodeCostModel
    _, cfg, _, _ = _setup(1)
    dc = cfg.decode_cost
    cap = 530
    dsa = DecodeCostModel(dc.intercept, dc.per_request, dc.per_context / 4, per_capped_context=dc.per_context * 3,
                          context_cap=cap)
    cfg = replace(cfg, decode_cost=dsa)
    trajs = [sim_cluster.TrajectorySpec(i, p, [(24, 40)]) for i, p in enumerate((488, 516, 492, 520))]
    recs = simulate(cfg, trajs, ["oracle"])["oracle"].records
    assert min(r.n_prompt for r in recs) + 1 < cap < max(r.n_prompt for r in recs) + 1
    shared = 0
    for r in recs:
        for i, (t0, t1) in enumerate(zip(r.token_times[1:], r.token_times[2:])):
            # every request decoding on r's engine at that step, at its own context then
            ctx = [x.n_prompt + x.token_times.index(t1) for x in recs if x.de == r.de and t1 in x.token_times]
            shared += len(ctx) > 1
            assert t1 - t0 == pytest.approx(dsa.step_cost(ctx) * cfg.dilation, rel=1e-9), (r.trajectory, i, ctx)
    assert shared > 30  # batches of two, crossing the cap at different steps


def test_online_arrivals_start_agents_later():
    _, cfg, _, trajs = _setup(4, aps=2.0)
    assert sorted(t.arrival_s for t in trajs)[-1] > 0
    res = simulate(cfg, trajs, ["dualpath"])["dualpath"]
    first = {}
    for r in res.records:
        first.setdefault(r.trajectory, r.t_arrive)
    for t in trajs:
        assert first[t.id] >= res.t0 + t.arrival_s


def test_a_burst_at_the_start_spreads_over_every_de_group():
    """The testbed's conductor submits once every group's leader has started and reported; a
    simulation that let the first requests in before that put the whole first burst on the group
    that happened to report first (1p2d-io: every first turn on d0, twice the DE SNIC queue)."""
    _, cfg, _, trajs = _setup(12, topo="1p2d-io", cal=Calibration(rpc_s=2e-3))
    res = simulate(cfg, trajs, ["dualpath"])["dualpath"]
    first = [r for r in res.records if r.turn == 0]
    per_node = {n: sum(r.de_node == n for r in first) for n in ("dpt-d0", "dpt-d1")}
    assert sum(per_node.values()) == 12 and min(per_node.values()) >= 4, per_node  # phase 1 balances tokens
    assert res.t0 > 0 and min(r.t_arrive for r in res.records) >= res.t0


def test_calibration_round_trips_and_rejects_bad_fields(tmp_path):
    c = Calibration(rpc_s=1e-3, pass_cpu=(1.0, 2.0, 3.0), source={"run": "x"})
    p = tmp_path / "cal.json"
    c.save(p)
    assert Calibration.load(p) == c
    with pytest.raises(ValueError, match="rpc_s"):
        Calibration(rpc_s=-1)
    with pytest.raises(ValueError, match="unknown field"):
        Calibration.from_dict({"rpc": 1})
    with pytest.raises(ValueError, match="compute_efficiency"):
        Calibration(compute_efficiency=0)


def test_latencies_lengthen_the_run():
    _, cfg0, _, trajs = _setup(2)
    _, cfg1, _, _ = _setup(2, cal=Calibration(rpc_s=5e-3, step_gap_s=1e-3))
    a = simulate(cfg0, trajs, ["dualpath"])["dualpath"].jct_s
    b = simulate(cfg1, trajs, ["dualpath"])["dualpath"].jct_s
    assert b > a


def test_a_measured_burst_beyond_the_bucket_leaves_at_once_too():
    """`dualpath bench burst` measures how far past its bucket a fresh flow goes; the calibration's
    burst_extra_bytes adds it per NIC kind: on a 1000 B/s SNIC with a 300 B bucket and 200 B more,
    1000 B take 0.5 s (0.7 s without); a kind it does not name keeps the bucket alone."""
    topo = load_topology(ROOT / "topologies" / "1p1d.yaml")
    cfg = sim_config(topo, cal=Calibration(burst_extra_bytes={"snic": 200.0}))
    cfg = cfg.__class__(**{**cfg.__dict__, "buckets": {"snic": 300.0, "cnic": 300.0}})
    sim = sim_cluster.ClusterSim(cfg, "dualpath", "layerwise", "shorter", [])
    snic, cnic = sim.shaped(Link("snic", 1000 * B, qos=False), "snic"), sim.shaped(Link("cnic", 1000 * B), "cnic")
    took = {}

    def one(name, link):
        t = sim.env.now
        yield sim._flow([link], 1000)
        took[name] = round(sim.env.now - t, 9)

    sim.env.process(one("snic", snic))
    sim.env.process(one("cnic", cnic))
    sim.env.run()
    assert took == {"snic": 0.5, "cnic": 0.7}
    with pytest.raises(ValueError, match="burst_extra_bytes"):
        Calibration(burst_extra_bytes={"snic": -1.0})


def test_a_shaped_link_with_capacity_to_spare_keeps_its_bucket_full():
    """HTB gains tokens at a class's rate and spends them on what it sends: a busy link whose flows
    leave it capacity to spare keeps its bucket full, and only a link its flows fill has none.
    Hand-solved with a 2000 B/s host port A and a 1000 B/s CNIC B, 300 B buckets each, and an
    unshaped 1000 B/s hop U: while a flow over [A, U] uses half of A, 1000 B over [A, B] take
    0.7 s (300 B at once, 700 B at B's rate); while a flow over [A] alone fills A, they take 1 s
    (no burst; A shared 1000 B/s each). A link left empty by a flow that could not fill it starts
    refilling from a full bucket (1000 B over [A] right after: 0.35 s), by one that filled it from
    empty (0.5 s)."""
    topo = load_topology(ROOT / "topologies" / "1p1d.yaml")
    cfg = sim_config(topo, cal=UNCALIBRATED)
    cfg = cfg.__class__(**{**cfg.__dict__, "buckets": {"host_port": 300.0, "cnic": 300.0}})
    sim = sim_cluster.ClusterSim(cfg, "dualpath", "layerwise", "shorter", [])
    a = sim.shaped(Link("A", 2000 * B, qos=False), "host_port")
    b = sim.shaped(Link("B", 1000 * B, qos=False), "cnic")
    u = Link("U", 1000 * B, qos=False)
    env, took = sim.env, []

    def one(path, nbytes):
        t = env.now
        yield sim._flow(path, nbytes)
        took.append(round(env.now - t, 9))

    def script():
        yield env.timeout(1.0)  # every bucket full
        bg = env.process(one([a, u], 2300))  # 300 B at once, then 2 s at 1000 B/s: A half used
        yield env.timeout(0.5)
        yield env.process(one([a, b], 1000))  # A keeps its bucket; B idle since the start: 0.7 s
        yield bg
        yield env.process(one([a], 1000))  # A's last flow could not fill it: full bucket, 0.35 s
        yield env.timeout(1.0)
        bg = env.process(one([a], 4300))  # 300 B at once, then A full at 2000 B/s
        yield env.timeout(0.5)
        yield env.process(one([b, a], 1000))  # B full again; A filled by the other: no burst, 1 s
        yield bg
        yield env.process(one([a], 1000))  # A's last flow filled it: from empty, 0.5 s

    env.process(script())
    env.run()
    # the background flows: 2000 B at 1000 B/s; 1000 B alone, 1000 B while shared, 2000 B alone
    assert took == pytest.approx([0.7, 2.0, 0.35, 1.0, 2.5, 0.5])


def test_jitter_draws_factors_of_mean_one_and_the_given_spread_from_the_seed():
    """A latency varies around its calibrated value, never below 0, with the fitted relative sd;
    the same seed gives the same draws (a simulation is reproducible), another seed others."""
    import statistics

    first = sim_parts._Jitter(0.8, "0:dualpath").factor()
    j = sim_parts._Jitter(0.8, "0:dualpath")
    xs = [j.factor() for _ in range(40_000)]
    assert xs[0] == first and min(xs) > 0
    assert statistics.fmean(xs) == pytest.approx(1.0, abs=0.03)
    assert statistics.pstdev(xs) == pytest.approx(0.8, rel=0.08)
    assert sim_parts._Jitter(0.8, "1:dualpath").factor() != xs[0]
    assert {sim_parts._Jitter(0.0, "0:x").factor() for _ in range(3)} == {1.0}
    with pytest.raises(ValueError, match="jitter"):
        Calibration(jitter=-0.1)


def test_jitter_reorders_events_by_seed_and_zero_jitter_is_the_exact_model():
    """With jitter, a simulation is one draw of the order of events: seeds differ, a seed repeats;
    jitter 0 ignores the seed."""
    from dataclasses import replace

    _, cfg, _, trajs = _setup(6, topo="1p2d-io", cal=Calibration(rpc_s=2e-3, flush_fixed_s=3e-3, jitter=1.0))
    def times(c):
        return sorted(r.t_done for r in simulate(c, trajs, ["dualpath-rr"])["dualpath-rr"].records)
    a, b, again = times(cfg), times(replace(cfg, seed=1)), times(cfg)
    assert a == again and a != b
    exact = replace(cfg, calibration=cfg.calibration.exact())
    assert times(exact) == times(replace(exact, seed=1))


def test_an_idle_shaped_link_sends_its_htb_bucket_at_once_and_refills_at_its_rate():
    """emulators/nic.py gives every shaped NIC an HTB bucket: after a pause, a flow's first bytes
    (up to the bucket) leave at line rate and the rest at the link's rate. Hand-solved on one SNIC
    of 1000 B/s with a 300 B bucket: 1000 B take 0.7 s; right after, 1000 B take 1 s (empty
    bucket); 0.1 s later, 100 B of tokens make it 0.9 s; a flow within the bucket takes no time;
    a flow that starts while another is on the link gets nothing from it."""
    topo = load_topology(ROOT / "topologies" / "1p1d.yaml")
    cfg = sim_config(topo, cal=UNCALIBRATED)
    assert cfg.buckets and sim_config(topo, cal=UNCALIBRATED, units="target").buckets == {}
    cfg = cfg.__class__(**{**cfg.__dict__, "buckets": {"snic": 300.0}})
    sim = sim_cluster.ClusterSim(cfg, "dualpath", "layerwise", "shorter", [])
    link = sim.shaped(Link("snic", 1000 * B, qos=False), "snic")
    link_other = Link("unshaped", 1000 * B)
    env, took = sim.env, []

    def one(nbytes, path=(link,)):
        t = env.now
        yield sim._flow(list(path), nbytes)
        took.append(round(env.now - t, 9))

    def script():
        yield from one(1000)  # full bucket: 700 B at 1000 B/s
        yield from one(1000)  # empty bucket
        yield env.timeout(0.1)
        yield from one(1000)  # 100 B refilled
        yield env.timeout(1.0)
        yield from one(250)  # within the full bucket
        yield from one(200, (link, link_other))  # 50 B left, and an unshaped hop takes none
        first = env.process(one(1000))
        yield env.timeout(0.5)
        yield env.process(one(100))  # the link is busy: no burst, it shares the link at 500 B/s
        yield first
        yield env.timeout(1.0)
        # an exposed pass's 4 layer READs of 250 B, one before each 0.1 s window: the first from the
        # full bucket, each later one from 100 B refilled in the window before it: 1000 - 250 - 300
        t = env.now
        yield sim._flow([link], 1000, layers=(4, 0.1))
        took.append(round(env.now - t, 9))

    env.process(script())
    env.run()
    assert took[:5] == [0.7, 1.0, 0.9, 0.0, 0.15]
    assert took[5] == pytest.approx(0.2)  # 100 B at half the link
    assert took[6:] == [1.1, 0.45]  # the first flow, then the layered READs
    # every byte is counted on the link, burst or not
    assert sim.net.net.delivered[link] == pytest.approx(1000 * 3 + 250 + 200 + 1000 + 100 + 1000)


def test_the_host_stretch_is_an_m_m_c_queues_response_factor():
    from simulator.parts import queue_stretch
    assert queue_stretch(0.0, 2) == 1.0
    for u in (0.1, 0.5, 0.63, 0.9):
        assert queue_stretch(u, 1) == pytest.approx(1 / (1 - u))  # M/M/1
        assert queue_stretch(u, 2) == pytest.approx(1 / (1 - u * u))  # M/M/2, in closed form
        assert 1 < queue_stretch(u, 8) < queue_stretch(u, 2) < queue_stretch(u, 1)  # more cores, less waiting
