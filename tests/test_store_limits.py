"""No client can starve the store: idle and slow connections are bounded in time, connections
in number (per server and per peer, with eviction of idle ones), file descriptors stay under
the limit, and blocks of 0 bytes or of the wrong size are refused.

Servers run in-process on 127.0.0.1 with ephemeral ports and small timeouts; the descriptor
tests run a real subprocess under prlimit.
"""
from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from dualpath.store import BadRequestError, ServerBusyError, StoreClient, chain_keys
from dualpath.store import client as client_mod
from dualpath.store.checksum import WRITE_ALGO, checksum
from dualpath.store.protocol import pack_frame, recv_header
from emulators.kvstore import server as server_mod
from emulators.kvstore.launch import ServerProcess
from tests.store_helpers import raw_request

BB = 32 * 1024


def block(i: int) -> bytes:
    return np.random.default_rng(900 + i).bytes(BB)


def keys_for(n: int, seed: int = 0) -> list[str]:
    return chain_keys(np.arange(seed, seed + 4 * n), 4, namespace=b"limits-tests")


def put_head(key: str, data: bytes, rid: int = 1) -> dict:
    return {"op": "put", "id": rid, "key": key, "n": len(data), "crc": checksum(data), "algo": WRITE_ALGO}


def wait_closed(s: socket.socket, within_s: float) -> tuple[dict | None, float]:
    """The error frame the server sent (if any) before closing, and how long it took."""
    t0 = time.monotonic()
    s.settimeout(within_s)
    reply = recv_header(s, eof_ok=True)
    if reply is not None:
        assert s.recv(1 << 16) == b""
    return reply, time.monotonic() - t0


# ---- time -----------------------------------------------------------------
def test_an_idle_connection_is_closed_and_the_client_reconnects(make_server):
    srv = make_server(idle_timeout_s=0.3)
    k = keys_for(1)[0]
    with socket.create_connection(srv.address, timeout=5) as s:
        reply, took = wait_closed(s, 5)
        assert reply is None and 0.2 < took < 2.0  # nothing was asked, nothing to answer
    with StoreClient([srv.address], BB) as c:
        assert c.put(k, block(0)) is True
        time.sleep(0.6)  # the server closes the client's connection meanwhile
        assert bytes(c.get(k)) == block(0)  # ... which reconnects without an error
        time.sleep(0.6)
        assert c.contains([k]) == [True]


def test_a_connection_closed_in_the_instant_before_a_request_is_retried_once(make_server, monkeypatch):
    srv = make_server(idle_timeout_s=0.3)
    keys = keys_for(3, seed=10)
    with StoreClient([srv.address], BB) as c:
        c.put_many([(k, block(i)) for i, k in enumerate(keys)])
        time.sleep(0.6)
        # Pretend the EOF had not arrived yet when the request went out (the race begin() cannot see).
        real_begin = client_mod._Connection.begin

        def blind_begin(self):
            reused = self._sock is not None
            return self.sock(), reused

        monkeypatch.setattr(client_mod._Connection, "begin", blind_begin)
        out = bytearray(3 * BB)
        c.get_many(keys, out)
        assert out == b"".join(block(i) for i in range(3))
        time.sleep(0.6)
        assert c.put_status([(keys[0], block(0))]) == ["exists"]
        time.sleep(0.6)
        assert c.stats()[0]["blocks"] == 3
        monkeypatch.setattr(client_mod._Connection, "begin", real_begin)


def test_a_stalled_put_payload_releases_its_reservation(make_server):
    srv = make_server(stall_timeout_s=0.5)
    k = keys_for(1, seed=20)[0]
    data = block(1)
    with socket.create_connection(srv.address, timeout=5) as s:
        s.sendall(pack_frame(put_head(k, data)) + data[: BB // 2])
        time.sleep(0.1)
        assert srv.store.stats()["reserved_bytes"] > 0  # the put holds capacity while it streams
        reply, took = wait_closed(s, 5)
    assert reply is not None and reply["err"] == "protocol" and reply["id"] == 1 and reply["key"] == k
    assert "payload too slow" in reply["msg"] and f"{BB // 2} of {BB} bytes" in reply["msg"]
    assert took < 2.0
    assert srv.store.stats()["reserved_bytes"] == 0 and not srv.store.has(k)
    with StoreClient([srv.address], BB) as c:
        assert c.put(k, data) is True


def test_a_trickling_put_is_cut_off_at_its_rate_floor(make_server):
    # 1 byte every 0.2 s never stalls for 0.5 s, but 32 KiB at 4 KiB/s is due after 0.5 + 8 s.
    srv = make_server(stall_timeout_s=0.5, min_rate_bytes_s=64 * 1024)
    k = keys_for(1, seed=30)[0]
    data = block(2)
    with socket.create_connection(srv.address, timeout=5) as s:
        s.sendall(pack_frame(put_head(k, data)))
        t0 = time.monotonic()
        try:
            for i in range(40):
                s.sendall(data[i : i + 1])
                time.sleep(0.05)
        except OSError:
            pass
        reply, _ = wait_closed(s, 5)
    assert time.monotonic() - t0 < 3.0  # 0.5 s + 32 KiB / 64 KiB/s = 1 s
    assert reply is not None and "payload too slow" in reply["msg"]
    assert srv.store.stats()["reserved_bytes"] == 0


def test_an_incomplete_header_is_cut_off(make_server):
    srv = make_server(header_timeout_s=0.5)
    frame = pack_frame({"op": "stat", "id": 1})
    with socket.create_connection(srv.address, timeout=5) as s:
        s.sendall(frame[:-2])
        reply, took = wait_closed(s, 5)
    assert reply is not None and reply["err"] == "protocol" and "header incomplete" in reply["msg"]
    assert 0.4 < took < 2.0
    assert raw_request(srv.address, {"op": "stat", "id": 2})["ok"] is True


def test_a_client_that_does_not_read_is_cut_off(make_server):
    srv = make_server(stall_timeout_s=0.5, idle_timeout_s=60)
    k = keys_for(1, seed=40)[0]
    with StoreClient([srv.address], BB) as c:
        c.put(k, block(4))
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(srv.address)
    try:
        # 8 x 128 x 32 KiB = 32 MiB of replies, never read: more than any socket buffer here
        # (tcp_wmem max is 16 MiB), so the server's sends stall and only its stall timeout ends them.
        s.sendall(b"".join(pack_frame({"op": "mget", "id": 1 + 128 * i, "keys": [k] * 128}) for i in range(8)))
        deadline = time.monotonic() + 5
        while srv._conns and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not srv._conns  # the server gave up on it, long before its idle timeout
    finally:
        s.close()


# ---- connections ----------------------------------------------------------
def test_idle_connections_cannot_lock_other_clients_out(make_server):
    srv = make_server(max_conns=8)
    k = keys_for(1, seed=50)[0]
    idle = [socket.create_connection(srv.address, timeout=5) for _ in range(8)]
    try:
        time.sleep(server_mod.EVICT_IDLE_S + 0.3)
        with StoreClient([srv.address], BB) as c:  # the longest-idle connection makes room
            assert c.put(k, block(3)) is True
            assert bytes(c.get(k)) == block(3)
        assert srv.evictions >= 1
        closed = 0
        for s in idle:
            s.settimeout(0.2)
            try:
                closed += s.recv(1) == b""
            except OSError:
                pass
        assert closed >= 1
    finally:
        for s in idle:
            s.close()


def test_busy_connections_get_a_clear_refusal(make_server):
    srv = make_server(max_conns=4, max_conns_per_peer=2, header_timeout_s=5)
    frame = pack_frame({"op": "stat", "id": 1})
    busy = []
    try:
        for _ in range(2):  # each in the middle of a request: not idle, not evictable
            s = socket.create_connection(srv.address, timeout=5)
            s.sendall(frame[:3])
            busy.append(s)
        time.sleep(0.2)
        with socket.create_connection(srv.address, timeout=5) as s:
            s.sendall(frame)
            reply = recv_header(s)
        assert reply["ok"] is False and reply["err"] == "busy" and reply["id"] == -1
        assert "limit of 2 connections from 127.0.0.1" in reply["msg"]
        with pytest.raises(ServerBusyError, match="limit of 2 connections"):
            with StoreClient([srv.address], BB) as c:
                c.stats()
        assert srv.refusals >= 2
    finally:
        for s in busy:
            s.close()
    deadline = time.monotonic() + 5
    while True:  # the slots free up once the server notices
        try:
            with StoreClient([srv.address], BB) as c:
                assert c.stats()[0]["max_conns"] == 4
            break
        except ServerBusyError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


# ---- file descriptors -----------------------------------------------------
def _prlimit_server(tmp_path: Path, nofile: str, *extra: str) -> ServerProcess:
    if shutil.which("prlimit") is None:
        pytest.skip("prlimit (util-linux) not installed")
    return ServerProcess(tmp_path / "fd", 1 << 30, wrap=lambda argv: ["prlimit", f"--nofile={nofile}", "--", *argv],
                         extra_args=list(extra))


def test_the_descriptor_limit_is_raised_to_the_hard_one(tmp_path: Path):
    with _prlimit_server(tmp_path, "256:4096") as sp:
        with StoreClient([sp.address], BB) as c:
            st = c.stats()[0]
    assert st["max_conns"] == (4096 - server_mod.FD_RESERVE) // server_mod.FDS_PER_CONN  # 59


def test_connections_stay_within_a_low_descriptor_limit(tmp_path: Path):
    """At a hard limit of 512, the server admits (512 - 64) // 68 = 6 connections; each reads
    ahead at most 64 files, so even 6 clients asking 2 x 128 blocks at once never hit EMFILE."""
    import threading

    keys = keys_for(128, seed=60)
    with _prlimit_server(tmp_path, "512:512", "--block-bytes", str(BB)) as sp:
        with StoreClient([sp.address], BB) as c:
            c.put_many([(k, block(i % 4)) for i, k in enumerate(keys)])
            assert c.stats()[0]["max_conns"] == 6
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                with StoreClient([sp.address], BB, window=128) as rc:
                    out = bytearray(len(keys) * BB)
                    for _ in range(2):
                        rc.get_many(keys, out)
                    assert all(out[i * BB : (i + 1) * BB] == block(i % 4) for i in range(len(keys)))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=reader) for _ in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        assert not errors, errors[:2]
        # One more than the limit is refused clearly, not left to run out of descriptors.
        extra = [socket.create_connection(sp.address, timeout=5) for _ in range(6)]
        try:
            for s in extra:
                s.sendall(pack_frame({"op": "stat", "id": 1})[:3])  # busy: not evictable
            time.sleep(0.3)
            with pytest.raises(ServerBusyError, match="limit of 6 connections"):
                with StoreClient([sp.address], BB) as c:
                    c.stats()
        finally:
            for s in extra:
                s.close()
        log = sp.log_path.read_text()
        assert "Too many open files" not in log and "Traceback" not in log


# ---- block sizes ----------------------------------------------------------
def test_zero_byte_and_wrong_size_blocks_are_refused(make_server):
    srv = make_server(block_bytes=BB)
    k = keys_for(1, seed=70)[0]
    for n in (0, 1, BB - 1, BB + 1):
        data = b"\x00" * n
        reply = raw_request(srv.address, put_head(k, data), data)
        assert reply["ok"] is False and reply["err"] == "bad_request" and reply["key"] == k, reply
        assert "\n" not in reply["msg"]
    assert not srv.store.has(k) and srv.store.stats()["reserved_bytes"] == 0
    with StoreClient([srv.address], BB) as c:
        assert c.put(k, block(5)) is True
    with StoreClient([srv.address], BB - 1) as c:  # a client of another block size gets a reason
        with pytest.raises(BadRequestError, match=f"exactly {BB} bytes"):
            c.put(keys_for(1, seed=71)[0], block(5)[:-1])


def test_a_store_without_a_block_size_still_refuses_empty_blocks(server):
    k = keys_for(1, seed=80)[0]
    reply = raw_request(server.address, put_head(k, b""))
    assert reply["ok"] is False and reply["err"] == "bad_request" and "outside [1," in reply["msg"]
    assert not server.store.has(k)
    frame = {"op": "put", "id": 2, "key": k, "n": True, "crc": 0, "algo": 2}  # a bool is not a size
    with socket.create_connection(server.address, timeout=5) as s:
        s.sendall(pack_frame(frame) + b"x")
        reply = recv_header(s)
    assert reply["ok"] is False and "'n'" in reply["msg"]
