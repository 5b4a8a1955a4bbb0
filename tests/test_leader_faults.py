"""Group leaders under faults (issue 14): a member or host agent that stops answering never
stops its leader; a silent engine is left out, a silent host agent reports its SNIC down."""
from __future__ import annotations

import os
import threading
import time

import zmq

from dualpath.control import REFUSED, Auth, RpcClient, RpcServer, pack, unpack
from dualpath.nodes.leader import EngineLoad, GroupLeader, group_reports, serve_state
from dualpath.scheduler.core import Scheduler
from dualpath.scheduler.messages import RequestMsg
from dualpath.scheduler.service import SchedulerClient, SchedulerError, SchedulerService
from dualpath.scheduler.thresholds import Profile
from tests.test_leader import IP, PROFILE, _control_port, _wait

LOAD = {"seq_e": 1, "tok_e": 10, "free_hbm_tokens": 90}
MEMBERS = {"p0": ("n0", "prefill", "ep"), "p1": ("n0", "prefill", "ep"),
           "d0": ("n1", "decode", "ep"), "d1": ("n2", "decode", "ep")}


def test_reports_leave_out_silent_engines_and_decode_engines_of_a_silent_host():
    out = group_reports("g", MEMBERS, {"p0": LOAD, "p1": None, "d0": LOAD, "d1": LOAD},
                        {"n0": None, "n1": {"bytes": 5, "snic_up": False}, "n2": {"bytes": 7}}, 2)
    by = {r["engine_id"]: r for r in out}
    assert set(by) == {"p0", "d0", "d1"}  # p1 is silent
    assert by["p0"]["snic_up"] is False and by["p0"]["read_q_bytes"] == 0  # its host agent is silent
    assert by["d0"]["snic_up"] is False and by["d0"]["read_q_bytes"] == 5  # its SNIC is down
    assert by["d1"]["snic_up"] is True and by["d1"]["free_hbm_bytes"] == 180
    out = group_reports("g", MEMBERS, {e: LOAD for e in MEMBERS}, {"n0": {"bytes": 0}, "n1": None, "n2": None}, 2)
    assert {r["engine_id"] for r in out} == {"p0", "p1"}  # a DE's KV lives in its host agent's buffer


def _service(secret=None):
    pulled: list = []
    sched = Scheduler(PROFILE, stale_after_s=1.0)
    svc = SchedulerService(sched, f"tcp://{IP}:*", on_pull=lambda g, a: pulled.append((g, a)), secret=secret)
    stop = threading.Event()
    th = threading.Thread(target=svc.serve, args=(10 ** 6, 60, stop), daemon=True)
    th.start()
    return svc, sched, pulled, lambda: (stop.set(), th.join(5), svc.close())


def test_a_dead_member_and_a_dead_host_do_not_stop_the_leader():
    secret = os.urandom(32)
    auth = Auth(secret)
    svc, sched, pulled, close = _service(secret)
    loads = {e: EngineLoad(hbm_tokens=10_000) for e in ("p0", "d0", "d1")}
    ports = {n: _control_port() for n in ("p0", "p1", "d0", "d1", "n0", "n1", "n2")}
    for e, load in loads.items():  # nothing will ever serve p1 (a dead engine) or n1 (a dead host agent)
        serve_state(IP, ports[e], {"load": load.report,
                                   "assigned": lambda request, tokens, _l=load: _l.assigned(request, tokens) or {}},
                    auth=auth)
    for n in ("n0", "n2"):
        serve_state(IP, ports[n], {"read_q": lambda: {"bytes": 0, "snic_up": True}}, auth=auth)
    ep = {n: f"tcp://{IP}:{p + 1}" for n, p in ports.items()}
    common = dict(kv_bytes_per_token=100, interval_s=0.01, max_seconds=60, secret=secret)
    leaders = [GroupLeader("pe", svc.endpoint, {"p0": ("n0", "prefill", ep["p0"]), "p1": ("n0", "prefill", ep["p1"])},
                           {"n0": ep["n0"]}, **common),
               GroupLeader("de-n1", svc.endpoint, {"d0": ("n1", "decode", ep["d0"])}, {"n1": ep["n1"]}, **common),
               GroupLeader("de-n2", svc.endpoint, {"d1": ("n2", "decode", ep["d1"])}, {"n2": ep["n2"]}, **common)]
    for lead in leaders:
        lead.start()
    client = SchedulerClient(svc.endpoint, secret=secret)
    try:
        for i in range(4):
            client.submit([RequestMsg(request_id=f"r{i}", hit_tokens=0, miss_tokens=10, total_len=10)])
        _wait(lambda: sum(len(got) for g, got in pulled if g == "pe") == 4, 15)
        got = [a for g, got in pulled if g == "pe" for a in got]
        assert {a.pe_engine for a in got} == {"p0"}  # the silent p1 was never reported, so never chosen
        assert {a.de_engine for a in got} == {"d1"}  # d0's host agent is silent: d0 is never offered
        assert "d0" not in sched.engines and "p1" not in sched.engines
        n = leaders[0].pulls
        _wait(lambda: leaders[0].pulls > n + 10)  # still pulling
        assert all(lead.error is None for lead in leaders)
        assert leaders[0].peers.down() == {"p1"} and leaders[1].peers.down() == {"n1"}
    finally:
        stats = [lead.stop() for lead in leaders]
        client.close()
        close()
    assert stats[0]["unreachable"] == ["p1"] and stats[0]["error"] is None
    assert stats[1]["unreachable"] == ["n1"]


def test_a_member_that_answers_again_is_reported_again():
    svc, sched, pulled, close = _service()
    load = EngineLoad(hbm_tokens=10_000)
    port = _control_port()
    lead = GroupLeader("pe", svc.endpoint, {"p0": ("n0", "prefill", f"tcp://{IP}:{port + 1}")}, {},
                       kv_bytes_per_token=100, interval_s=0.01, max_seconds=60).start()
    try:
        _wait(lambda: lead.peers.down() == {"p0"}, 10)
        serve_state(IP, port, {"load": load.report, "assigned": lambda request, tokens: {}})  # it comes back
        _wait(lambda: "p0" in sched.engines, 10)
        assert lead.peers.down() == set()
    finally:
        lead.stop()
        close()


def test_the_scheduler_service_and_rpc_servers_refuse_unsigned_messages():
    secret = os.urandom(32)
    svc, sched, _, close = _service(secret)
    try:
        good = SchedulerClient(svc.endpoint, secret=secret)
        assert good.ping()
        for wrong in (None, os.urandom(32)):
            c = SchedulerClient(svc.endpoint, timeout_s=3, secret=wrong)
            try:
                c.submit([RequestMsg(request_id="x", hit_tokens=0, miss_tokens=1, total_len=1)])
                raise AssertionError("an unsigned submit was accepted")
            except SchedulerError as e:
                assert "refused" in str(e)
            c.close()
        assert sched.pe_waiting == 0 and svc.auth.refused == 2
        good.close()
    finally:
        close()
    port = _control_port()
    ran = []
    srv = RpcServer(f"tcp://{IP}:{port}", {"shutdown": lambda: ran.append(1) or {"shutdown": True}},
                    auth=Auth(secret))
    th = threading.Thread(target=srv.serve, args=(30,), daemon=True)
    th.start()
    ctx = zmq.Context()
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://{IP}:{port}")
    s.send(pack({"cmd": "shutdown", "args": {}}))
    assert s.poll(5000) and unpack(s.recv()) == {"ok": False, "error": REFUSED}
    assert not ran and th.is_alive()
    s.send_multipart([secret, pack({"cmd": "shutdown", "args": {}})])
    assert s.poll(5000) and unpack(s.recv())["ok"] is True
    th.join(5)
    assert ran == [1]
    s.close()
    ctx.term()
