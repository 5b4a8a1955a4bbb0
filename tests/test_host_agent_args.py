"""The host agent refuses malformed flush / load / wait_notifs arguments at once, with one line
naming the command and the field, and keeps serving.

The argument checks are tested directly; one test runs a real host agent (its NIXL agent on
the loopback interface, in the root namespace: no namespaces, no shaping) against a store
server on loopback and sends it malformed requests over its control and load sockets.
"""
from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from dualpath.nodes.common import jobs_port, load_port
from dualpath.nodes.host import MAX_TIMEOUT_S, check_blocks, check_flush, check_timeout, check_wait_notifs
from dualpath.control import pack, unpack
from dualpath.store import StoreClient, chain_keys
from tests.conftest import REPO

FB = 4096
BUF = 16 * FB
SECRET = os.urandom(32)  # the run's secret, handed to the agent on its stdin
KEYS = chain_keys(np.arange(16 * 64), 16, namespace=b"host-args")


@pytest.mark.parametrize("args, field", [
    ((KEYS[:2], 0, [1], 1.0), "crcs"),  # one CRC for two keys
    ((KEYS[:1], 0, [1, 2], 1.0), "crcs"),
    ((KEYS[:1], -FB, [1], 1.0), "offset"),  # a negative offset
    ((KEYS[:1], BUF - FB + 1, [1], 1.0), "offset"),  # runs past the end
    ((KEYS[:4], 13 * FB, [1] * 4, 1.0), "offset"),
    ((KEYS[:1], 0, [1], math.nan), "timeout_s"),  # NaN never expires
    ((KEYS[:1], 0, [1], math.inf), "timeout_s"),
    ((KEYS[:1], 0, [1], -1.0), "timeout_s"),
    ((KEYS[:1], 0, [1], 0.0), "timeout_s"),
    ((KEYS[:1], 0, [1], 1e9), "timeout_s"),
    ((KEYS[:1], 0, [1], True), "timeout_s"),
    ((["../../etc/passwd"], 0, [1], 1.0), "keys"),
    (([KEYS[0].upper()], 0, [1], 1.0), "keys"),
    (([7], 0, [1], 1.0), "keys"),
    ((KEYS[:1], 0, [-1], 1.0), "crcs"),
    ((KEYS[:1], 0, [1 << 32], 1.0), "crcs"),
    ((KEYS[:1], 0, [True], 1.0), "crcs"),
    ((KEYS[:1], True, [1], 1.0), "offset"),
])
def test_flush_arguments_are_checked(args, field):
    with pytest.raises(ValueError) as e:
        check_flush(*args, BUF, FB)
    msg = str(e.value)
    assert msg.startswith("flush: field ") and f"'{field}'" in msg and "\n" not in msg and len(msg) < 300


def test_valid_flush_load_and_wait_arguments_pass():
    assert check_flush(KEYS[:16], 0, [0] * 16, 10.0, BUF, FB) == 10.0
    assert check_flush([], BUF, [], 1, BUF, FB) == 1.0  # nothing to write, at the very end
    check_blocks("load", KEYS[:1], BUF - FB, BUF, FB)
    assert check_wait_notifs("p0e1", ["r1/wb0", "r1/wb1"], 60.0) == 60.0
    assert check_timeout("x", MAX_TIMEOUT_S) == MAX_TIMEOUT_S


@pytest.mark.parametrize("args, field", [
    (("", ["m"], 1.0), "peer"),
    (("x" * 10_000, ["m"], 1.0), "peer"),
    ((None, ["m"], 1.0), "peer"),
    (("p", "m", 1.0), "msgs"),
    (("p", [""], 1.0), "msgs"),
    (("p", [3], 1.0), "msgs"),
    (("p", ["m"] * 70_000, 1.0), "msgs"),
    (("p", ["m"], math.nan), "timeout_s"),
    (("p", ["m"], -math.inf), "timeout_s"),
])
def test_wait_notifs_arguments_are_checked(args, field):
    with pytest.raises(ValueError) as e:
        check_wait_notifs(*args)
    msg = str(e.value)
    assert msg.startswith("wait_notifs: field ") and f"'{field}'" in msg and len(msg) < 300


# ---- a real host agent on loopback ----------------------------------------
def _free_port_block(n: int = 4) -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65536:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    pytest.skip("no block of free ports")


@pytest.fixture
def host_agent(make_server, tmp_path: Path):
    pytest.importorskip("nixl_cu12")
    srv = make_server(block_bytes=FB)
    port = _free_port_block()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    log = open(tmp_path / "host.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "dualpath.nodes.host", "--name", "h0", "--iface", "lo",
                             "--ip", "127.0.0.1", "--control-port", str(port), "--buffer-bytes", str(BUF),
                             "--block-bytes", str(FB), "--store", "%s:%d" % srv.address],
                            stdout=subprocess.PIPE, stderr=log, stdin=subprocess.PIPE, env=env, cwd=REPO)
    proc.stdin.write(SECRET.hex().encode() + b"\n")
    proc.stdin.close()
    try:
        line = proc.stdout.readline()
        if not line.startswith(b"ready"):
            pytest.skip(f"host agent did not start on loopback: {(tmp_path / 'host.log').read_text()[-300:]}")
        yield srv, port, proc
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


def _rpc(sock: zmq.Socket, cmd: str, **args) -> tuple[dict, float]:
    t0 = time.monotonic()
    sock.send_multipart([SECRET, pack({"cmd": cmd, "args": args})])
    assert sock.poll(5000), f"no reply to {cmd}"
    return unpack(sock.recv()), time.monotonic() - t0


def test_a_host_agent_refuses_bad_arguments_and_keeps_serving(host_agent):
    srv, port, _ = host_agent
    with StoreClient([srv.address], FB) as c:
        c.put(KEYS[0], bytes(range(256)) * (FB // 256))
    ctx = zmq.Context()
    ctl = ctx.socket(zmq.REQ)
    ctl.setsockopt(zmq.LINGER, 0)
    ctl.connect(f"tcp://127.0.0.1:{port}")
    ld = ctx.socket(zmq.DEALER)
    ld.setsockopt(zmq.LINGER, 0)
    ld.connect(f"tcp://127.0.0.1:{load_port(port)}")
    jobs = ctx.socket(zmq.DEALER)  # flush and wait_notifs: many at once, answered by id
    jobs.setsockopt(zmq.LINGER, 0)
    jobs.connect(f"tcp://127.0.0.1:{jobs_port(port)}")
    try:
        bad = [
            ("flush", {"keys": KEYS[:2], "offset": 0, "crcs": [1], "timeout_s": 1.0}, "crcs"),
            ("flush", {"keys": KEYS[:1], "offset": -8, "crcs": [1], "timeout_s": 1.0}, "offset"),
            ("flush", {"keys": KEYS[:1], "offset": 0, "crcs": [1], "timeout_s": math.nan}, "timeout_s"),
            ("flush", {"keys": KEYS[:1], "offset": 0, "crcs": [1], "timeout_s": "inf"}, "timeout_s"),
            ("wait_notifs", {"peer": "nobody", "msgs": ["x"], "timeout_s": math.nan}, "timeout_s"),
            ("wait_notifs", {"peer": "nobody", "msgs": "x"}, "msgs"),
            # Taken as sent: no "0" or true for an offset, no true for a CRC (pydantic's lax mode converts them).
            ("flush", {"keys": KEYS[:1], "offset": "0", "crcs": [1], "timeout_s": 1.0}, "offset"),
            ("flush", {"keys": KEYS[:1], "offset": True, "crcs": [1], "timeout_s": 1.0}, "offset"),
            ("flush", {"keys": KEYS[:1], "offset": 0, "crcs": [True], "timeout_s": 1.0}, "crcs.0"),
            # the buffer's allocator: no area larger than the buffer, none of a foreign offset
            ("alloc", {"nbytes": BUF + 1}, "nbytes"),
            ("alloc", {"nbytes": "64"}, "nbytes"),
            ("free", {"offset": 4096, "epoch": 7}, "epoch"),
        ]
        for i, (cmd, args, field) in enumerate(bad):
            t0 = time.monotonic()
            jobs.send_multipart([b"", SECRET, pack({"cmd": cmd, "args": args, "id": i})])
            assert jobs.poll(5000), f"no reply to {cmd}"
            reply, took = unpack(jobs.recv_multipart()[-1]), time.monotonic() - t0
            assert reply["ok"] is False and reply["id"] == i and f"field '{field}'" in reply["error"] \
                and took < 2.0, (cmd, args, reply)
        reply, _ = _rpc(ctl, "contains", keys=KEYS[:2])  # still serving
        assert reply == {"ok": True, "present": [True, False]}
        loads = [({"keys": KEYS[:1], "offset": -1}, "offset"), ({"keys": KEYS[:1], "offset": BUF}, "offset"),
                 ({"keys": ["nope"], "offset": 0}, "keys"), ({"keys": KEYS[:1], "offset": "0"}, "offset"),
                 ({"keys": KEYS[:1], "offset": True}, "offset")]
        for i, (args, field) in enumerate(loads):
            ld.send_multipart([b"", SECRET, pack({"cmd": "load", "args": args, "id": i})])
            assert ld.poll(2000), args
            reply = unpack(ld.recv_multipart()[-1])
            assert reply["ok"] is False and reply["id"] == i and f"'{field}'" in reply["error"], reply
        ld.send_multipart([b"", SECRET, pack({"cmd": "load", "args": {"keys": KEYS[:1], "offset": FB}, "id": 99})])
        assert ld.poll(5000)
        reply = unpack(ld.recv_multipart()[-1])
        assert reply["ok"] is True and reply["bytes"] == FB and reply["id"] == 99 and reply["failed_at"] == -1
        # a block the store lacks is not an error of the load: the reply names it, as a miss
        ld.send_multipart([b"", SECRET, pack({"cmd": "load", "args": {"keys": KEYS[:3], "offset": 0}, "id": 100})])
        assert ld.poll(5000)
        reply = unpack(ld.recv_multipart()[-1])
        assert reply["ok"] is True and reply["failed_at"] == 1 and set(reply["errors"]) == set(KEYS[1:3]), reply
        assert all(v.startswith("missing") for v in reply["errors"].values())
        reply, _ = _rpc(ctl, "read_log")
        assert reply["ok"] is True and len(reply["loads"]) == 2  # the refused loads were never queued
    finally:
        ctl.close()
        ld.close()
        jobs.close()
        ctx.term()


def test_every_socket_of_a_host_agent_refuses_a_message_without_the_run_secret(host_agent):
    """Issue 14 item 5: a process that does not hold the run's secret (here: this test, outside
    any of the testbed's namespaces) cannot drive a node: every socket answers with a refusal,
    runs nothing, and the agent keeps serving its conductor."""
    from dualpath.control import REFUSED
    from dualpath.nodes.common import state_port

    srv, port, proc = host_agent
    ctx = zmq.Context()
    socks = []

    def sock(kind, p):
        s = ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{p}")
        socks.append(s)
        return s

    try:
        for secret in ([], [b"x" * 32], [os.urandom(32)], [SECRET[:-1]]):  # none, wrong, or cut short
            ctl = sock(zmq.REQ, port)
            ctl.send_multipart([*secret, pack({"cmd": "shutdown", "args": {}})])
            assert ctl.poll(5000)
            assert unpack(ctl.recv()) == {"ok": False, "error": REFUSED}
            st = sock(zmq.REQ, state_port(port))
            st.send_multipart([*secret, pack({"cmd": "read_q", "args": {}})])
            assert st.poll(5000) and unpack(st.recv())["error"] == REFUSED
            for p, cmd, args in ((load_port(port), "load", {"keys": KEYS[:1], "offset": 0}),
                                 (jobs_port(port), "flush", {"keys": KEYS[:1], "offset": 0, "crcs": [0],
                                                             "timeout_s": 1.0})):
                d = sock(zmq.DEALER, p)
                d.send_multipart([b"", *secret, pack({"cmd": cmd, "args": args, "id": 1})])
                assert d.poll(5000)
                assert unpack(d.recv_multipart()[-1])["error"] == REFUSED
        time.sleep(0.2)
        assert proc.poll() is None  # the unsigned shutdowns did nothing
        ctl = sock(zmq.REQ, port)
        reply, _ = _rpc(ctl, "read_log")
        assert reply["ok"] is True and reply["loads"] == []  # the unsigned load was never queued
        st = sock(zmq.REQ, state_port(port))
        reply, _ = _rpc(st, "read_q")
        assert reply == {"ok": True, "bytes": 0, "snic_up": True}
    finally:
        for s in socks:
            s.close()
        ctx.term()


def test_a_node_process_does_not_start_without_a_secret(tmp_path):
    pytest.importorskip("nixl_cu12")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "dualpath.nodes.host", "--name", "h0", "--iface", "lo",
                        "--ip", "127.0.0.1", "--control-port", "1", "--buffer-bytes", str(BUF),
                        "--block-bytes", str(FB), "--store", "127.0.0.1:1"],
                       capture_output=True, stdin=subprocess.DEVNULL, env=env, cwd=REPO, timeout=60)
    assert p.returncode != 0 and b"no run secret on stdin" in p.stderr and p.stdout == b""
