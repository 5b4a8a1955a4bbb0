"""The ZeroMQ service: leaders pull over tcp://127.0.0.1 (ephemeral port); bad input gets a clear
error and the service keeps serving."""
from __future__ import annotations

import threading

import msgpack
import pytest
import zmq

from dualpath.scheduler import Profile, Scheduler
from dualpath.scheduler.messages import pack
from dualpath.scheduler.service import SchedulerClient, SchedulerError, SchedulerService

PROFILE = Profile(snic_bytes_per_s=1e6, prefill_tokens_per_s=1e3, kv_bytes_per_token=100, block_tokens=16)


@pytest.fixture
def service():
    svc = SchedulerService(Scheduler(PROFILE), "tcp://127.0.0.1:*")
    assert svc.endpoint.startswith("tcp://127.0.0.1:")
    stop = threading.Event()
    t = threading.Thread(target=svc.serve, kwargs=dict(max_messages=1000, max_seconds=60, stop=stop), daemon=True)
    t.start()
    client = SchedulerClient(svc.endpoint, timeout_s=5.0)
    try:
        yield svc, client
    finally:
        stop.set()
        t.join(timeout=10)
        client.close()
        svc.close()
    assert not t.is_alive()


def report(eid, node, role, group, **kw):
    d = dict(engine_id=eid, node_id=node, role=role, group_id=group, seq_e=0, tok_e=0,
             free_hbm_tokens=10**6, free_hbm_bytes=10**8, read_q_bytes=0)
    d.update(kw)
    return d


def test_pull_flow_over_zmq(service):
    _, c = service
    assert c.ping()
    assert c.submit([{"request_id": f"r{i}", "total_len": 170, "hit_tokens": 160, "miss_tokens": 10}
                     for i in range(3)]) == 3
    pe_reps = [report("p0", "pn", "prefill", "pg")]
    de_reps = [report("d0", "dn", "decode", "dg")]
    assert c.pull("pg", pe_reps) == []
    got = c.pull("dg", de_reps)
    assert [a.request_id for a in got] == ["r0", "r1", "r2"]
    assert [a.path for a in got] == ["pe", "de", "pe"]
    assert [a.request_id for a in c.pull("pg", pe_reps)] == ["r0", "r1", "r2"]
    assert c.stats()["queues"]["undelivered_to_pe"] == 0


BAD = [
    (b"\xc1\xc1 not msgpack", ""),
    (pack([1, 2, 3]), ""),
    (pack({"msg_id": 1}), "type"),
    (pack({"type": "teleport", "msg_id": 1}), "type"),
    (pack({"type": "ping"}), "msg_id"),
    (pack({"type": "ping", "msg_id": 1, "extra": True}), "extra"),
    (pack({"type": "pull", "msg_id": 1, "group_id": "g",
           "reports": [report("e", "n", "prefill", "g", tok_e=-5)]}), "reports.0.tok_e"),
    (pack({"type": "pull", "msg_id": 1, "group_id": "g",
           "reports": [report("e", "n", "prefill", "g", read_q_bytes="lots")]}), "reports.0.read_q_bytes"),
    (pack({"type": "pull", "msg_id": 1, "group_id": "g",
           "reports": [report("e", "n", "gpu", "g")]}), "reports.0.role"),
    (pack({"type": "pull", "msg_id": 1, "group_id": "g",
           "reports": [report("e", "n", "prefill", "other")]}), "reports.0.group_id"),
    (pack({"type": "submit", "msg_id": 1, "requests": [
        {"request_id": "x", "total_len": 5, "hit_tokens": 1, "miss_tokens": 1}]}), "requests.0.total_len"),
    (pack({"type": "submit", "msg_id": 1, "requests": []}), "requests"),
    (msgpack.packb({"type": "ping", "msg_id": 1, 7: 1}), ""),  # non-string key
]


@pytest.mark.parametrize("payload,field", BAD)
def test_malformed_messages_get_an_error_naming_the_field(service, payload, field):
    svc, c = service
    reply = c.call_raw(payload)
    assert reply["type"] == "error"
    assert reply["field"] == field
    assert reply["error"]
    assert c.ping()  # still serving
    assert svc.errors == 1


def test_client_raises_and_duplicate_submit_is_all_or_nothing(service):
    svc, c = service
    ok = {"request_id": "a", "total_len": 2, "hit_tokens": 1, "miss_tokens": 1}
    c.submit([ok])
    with pytest.raises(SchedulerError) as ei:
        c.submit([{**ok, "request_id": "b"}, ok])
    assert ei.value.field == "requests.1.request_id"
    assert c.stats()["queues"]["pe_waiting"] == 1  # "b" was not admitted either


def test_core_refusals_and_internal_errors_do_not_stop_the_service(service, monkeypatch):
    svc, c = service
    c.pull("g", [report("a", "n", "prefill", "g")])
    with pytest.raises(SchedulerError) as ei:  # a group cannot hold both roles
        c.pull("g", [report("b", "n", "decode", "g")])
    assert "prefill" in ei.value.error and "internal" not in ei.value.error
    def boom(group_id):
        raise KeyError("bug")
    monkeypatch.setattr(svc.scheduler, "pull", boom)
    with pytest.raises(SchedulerError) as ei:
        c.pull("g")
    assert "internal error" in ei.value.error
    assert c.ping() and svc.errors == 2


def test_wrong_frame_counts_and_raw_sockets(service):
    svc, _ = service
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(svc.endpoint)
    try:
        s.send_multipart([b"", b"a", b"b"])
        reply = msgpack.unpackb(s.recv_multipart()[-1])
        assert reply["type"] == "error" and "frame" in reply["error"]
        s.send_multipart([pack({"type": "ping", "msg_id": 9})])  # no delimiter is fine too
        assert msgpack.unpackb(s.recv_multipart()[-1]) == {"type": "pong", "msg_id": 9}
    finally:
        s.close()


def test_serve_is_bounded_by_count_and_time():
    svc = SchedulerService(Scheduler(PROFILE), "tcp://127.0.0.1:*")
    try:
        assert svc.serve(max_messages=10, max_seconds=0.2) == 0  # returns on the deadline
        c = SchedulerClient(svc.endpoint, timeout_s=0.3)
        with pytest.raises(TimeoutError):  # nobody serving: the client gives up, bounded
            c.ping()
        # the late request is still queued; serving exactly one message answers it and returns
        assert svc.serve(max_messages=1, max_seconds=5) == 1
        c.close()
    finally:
        svc.close()
