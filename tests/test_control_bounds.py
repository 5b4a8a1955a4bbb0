"""Control-plane requests are unpacked within bounds (time, memory, nesting) and every error
reply is one short line naming the command and field; the servers keep answering.

In-process: RpcServer.handle and the read queue's ROUTER message handling (no sockets used
beyond a bound endpoint).
"""
from __future__ import annotations

import time

import msgpack
import pytest

from dualpath.nodes.read_queue import ReadQueueServer
from dualpath.control import MAX_REQUEST_ITEMS, RpcServer, pack
from tests.conftest import BOUNDED_S, within_bounds


def add(a: int, b: int) -> dict:
    return {"sum": a + b}


def boom() -> dict:
    raise RuntimeError("line one\nline two " + "x" * 5000)


def not_a_map() -> dict:
    return [1, 2]  # type: ignore[return-value]


@pytest.fixture(scope="module")
def rpc():
    s = RpcServer("inproc://control-bounds", {"add": add, "boom": boom, "not_a_map": not_a_map})
    yield s
    s.sock.close()
    s.ctx.term()


def bombs() -> list[tuple[str, bytes]]:
    n = 8_000_000
    return [
        ("8M empty arrays", b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n),
        ("8M empty maps", b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n),
        ("nested 2-element arrays", b"\x92" * 200_000 + b"\x90" * 200_001),
        ("array header claiming 4G items", b"\xdd\xff\xff\xff\xff\x00"),
        ("str header claiming 4 GiB", b"\xdb\xff\xff\xff\xff"),
        ("100k-deep nesting", b"\x91" * 100_000 + b"\x00"),
        ("a map 100k deep", b"\x81\xa1a" * 100_000 + b"\x00"),
        ("ext type", msgpack.packb(msgpack.ExtType(5, b"x" * 100))),
        ("empty", b""),
        ("truncated", pack({"cmd": "add", "args": {"a": 1, "b": 2}})[:-1]),
    ]


@pytest.mark.parametrize("name, payload", bombs(), ids=[b[0] for b in bombs()])
def test_malformed_requests_are_refused_in_bounded_time_and_memory(rpc, name, payload):
    reply = within_bounds(lambda: rpc.handle(payload), max_bytes=200 << 20)
    assert reply["ok"] is False and "\n" not in reply["error"] and len(reply["error"]) <= 300, reply
    assert rpc.handle(pack({"cmd": "add", "args": {"a": 2, "b": 3}})) == {"ok": True, "sum": 5}


@pytest.mark.parametrize("msg, words", [
    ({"cmd": "x" * 1_000_000}, "unknown command"),
    ({"cmd": "add\nrm -rf"}, "unknown command"),
    ({"cmd": "add", "args": [1, 2]}, "field 'args'"),
    ({"cmd": "add", "args": {1: 2}}, "argument names must be strings"),
    ({"cmd": "add", "args": {"a": "x" * 100_000, "b": 1}}, "field 'a'"),
    ({"cmd": "add", "args": {"a": 1, "b": 2, "c" * 10_000: 3}}, "add: field"),
    ({"cmd": "boom"}, "boom: RuntimeError: line one line two"),
    ({"cmd": "not_a_map"}, "not_a_map: TypeError"),
    ({"cmd": 5}, "'cmd'"),
])
def test_error_replies_are_one_short_line_naming_the_command(rpc, msg, words):
    reply = rpc.handle(msgpack.packb(msg, use_bin_type=True))
    assert reply["ok"] is False and words in reply["error"], reply
    assert "\n" not in reply["error"] and len(reply["error"]) <= 300


def test_a_large_real_request_still_fits():
    """A prefill batch of long prompts: 8 requests of 100k token ids each."""
    from dualpath.control import unpack_request

    msg = {"cmd": "prefill_batch", "args": {"requests": [{"tokens": list(range(100_000))} for _ in range(8)]}}
    assert unpack_request(pack(msg)) == msg
    too_big = {"cmd": "x", "args": {"a": [0] * (MAX_REQUEST_ITEMS + 1)}}
    with pytest.raises(ValueError):
        unpack_request(pack(too_big))


def test_the_read_queue_refuses_malformed_loads_at_once():
    loads: list = []
    q = ReadQueueServer("inproc://rq-bounds", 100, lambda keys, offset: loads.append(keys) or {"bytes": 0},
                        check=lambda keys, offset: None)
    for name, payload in bombs():
        t0 = time.monotonic()
        reply = q._server._accept(payload, b"id")
        assert reply is not None and reply["ok"] is False and time.monotonic() - t0 < BOUNDED_S, name
        assert "\n" not in reply["error"] and len(reply["error"]) <= 300
    for msg, words in [
        ({"cmd": "load", "args": {"keys": ["k"] * 70_000, "offset": 0}, "id": 1}, "at most 65536"),
        ({"cmd": "load", "args": {"keys": ["k" * 1000], "offset": 0}, "id": 2}, "not a block key"),
        ({"cmd": "load", "args": {"keys": ["k"], "offset": -1}, "id": 3}, "'offset'"),
        ({"cmd": "load", "args": {"keys": ["k"], "offset": "1"}, "id": 4}, "'offset'"),
        ({"cmd": "load", "args": {"keys": "k", "offset": 0}, "id": 5}, "'keys'"),
        ({"cmd": "load", "args": {"keys": ["k"], "offset": 0, "extra": 1}, "id": 6}, "'extra'"),
        ({"cmd": "load", "args": {1: 2}, "id": 7}, "must be strings"),
        ({"cmd": "load", "args": {"keys": ["k"], "offset": 0}, "id": {"a": [1] * 1000}}, "serves"),
    ]:
        if msg["id"] == {"a": [1] * 1000}:
            msg["args"] = []  # not a map: refused, and the odd id is not echoed back
        reply = q._server._accept(pack(msg), b"id")
        assert reply is not None and reply["ok"] is False and words in reply["error"], (msg, reply)
        assert reply["id"] in (None, msg["id"]) and not isinstance(reply["id"], dict)
    assert q.pending_bytes == 0 and q._server._work.empty()
    assert q._server._accept(pack({"cmd": "load", "args": {"keys": ["k"], "offset": 0}, "id": 9}), b"id") is None
    assert q.pending_bytes == 100
