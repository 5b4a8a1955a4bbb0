"""The server's one-mget look-ahead: prefetch the next batch while the current one is sent.

Replies must stay in request order whatever is pipelined behind an mget, and
files opened early must be closed on every path. Servers run in-process on
127.0.0.1 with ephemeral ports.
"""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from dualpath.store import StoreClient, chain_keys
from dualpath.store.protocol import pack_frame, recv_exact_into, recv_header
from emulators.kvstore.server import StoreServer

BB = 32 * 1024


def block(i: int) -> bytes:
    return np.random.default_rng(300 + i).bytes(BB)


def keys_for(n: int, seed: int = 0) -> list[str]:
    return chain_keys(np.arange(seed, seed + 4 * n), 4, namespace=b"lookahead-tests")


@pytest.fixture
def stored(server: StoreServer) -> list[str]:
    keys = keys_for(8)
    with StoreClient([server.address], BB) as c:
        c.put_many([(k, block(i)) for i, k in enumerate(keys)])
    return keys


def read_replies(sock: socket.socket, n: int) -> list[tuple[dict, bytes]]:
    out = []
    for _ in range(n):
        reply = recv_header(sock)
        assert reply is not None
        payload = bytearray(reply.get("n", 0) if reply.get("ok") else 0)
        recv_exact_into(sock, memoryview(payload))
        out.append((reply, bytes(payload)))
    return out


def record_hints_and_sends(srv: StoreServer, keys: list[str], monkeypatch) -> list[tuple[str, int]]:
    """Events ("hint" | "send", index of the block in keys), in the order the server made them."""
    events: list[tuple[str, int]] = []
    fd_key: dict[int, str] = {}
    real_open, real_prefetch, real_send = srv.store.open_fd, srv.store.prefetch_fd, srv._send_block

    def open_fd(key: str) -> int:
        fd = real_open(key)
        fd_key[fd] = key
        return fd

    def prefetch_fd(fd: int) -> int:
        events.append(("hint", keys.index(fd_key[fd])))
        return real_prefetch(fd)

    def send_block(conn, rid, handle, scratch) -> None:
        events.append(("send", keys.index(handle.key)))
        real_send(conn, rid, handle, scratch)

    monkeypatch.setattr(srv.store, "open_fd", open_fd)
    monkeypatch.setattr(srv.store, "prefetch_fd", prefetch_fd)
    monkeypatch.setattr(srv, "_send_block", send_block)
    return events


def test_next_mget_is_read_ahead_before_the_current_one_is_sent(server: StoreServer, stored: list[str], monkeypatch):
    events = record_hints_and_sends(server, stored, monkeypatch)
    with socket.create_connection(server.address, timeout=10) as s:
        # Both frames in one write, as a client refilling its window sends them.
        s.sendall(pack_frame({"op": "mget", "id": 10, "keys": stored[:4]}) + pack_frame({"op": "mget", "id": 14, "keys": stored[4:]}))
        replies = read_replies(s, 8)
    assert [r["id"] for r, _ in replies] == list(range(10, 18))
    assert [p for _, p in replies] == [block(i) for i in range(8)]
    # 8 small blocks fit the read-ahead: the second batch's reads started before the first block went out.
    assert events.index(("hint", 7)) < events.index(("send", 0))
    assert [i for e, i in events if e == "send"] == list(range(8))
    assert [i for e, i in events if e == "hint"] == list(range(8))  # each once, in send order


@pytest.mark.parametrize("blocks_ahead", [0, 2])
def test_read_ahead_stays_within_its_bytes(tmp_path: Path, monkeypatch, blocks_ahead: int):
    # Each file is 64 + BB bytes: room for `blocks_ahead` of them, the one being sent included.
    srv = StoreServer(tmp_path / "ra", 1 << 30, ("127.0.0.1", 0), readahead_bytes=blocks_ahead * (64 + BB))
    srv.start()
    try:
        keys = keys_for(8, seed=500)
        with StoreClient([srv.address], BB) as c:
            c.put_many([(k, block(i)) for i, k in enumerate(keys)])
        events = record_hints_and_sends(srv, keys, monkeypatch)
        with socket.create_connection(srv.address, timeout=10) as s:
            s.sendall(pack_frame({"op": "mget", "id": 1, "keys": keys[:5]}) + pack_frame({"op": "mget", "id": 6, "keys": keys[5:]}))
            assert [p for _, p in read_replies(s, 8)] == [block(i) for i in range(8)]
    finally:
        srv.stop()
    hinted = -1
    for e, i in events:
        if e == "hint":
            assert i == hinted + 1  # in order, across the two batches
            hinted = i
        else:
            assert hinted >= i  # the block being sent was always hinted first ...
            assert hinted <= i + max(0, blocks_ahead - 1)  # ... and never more than the budget ahead
    assert hinted == 7


def test_other_requests_behind_an_mget_keep_their_order(server: StoreServer, stored: list[str]):
    missing = keys_for(1, seed=900)[0]
    frames = [
        pack_frame({"op": "mget", "id": 1, "keys": stored[:2]}),
        pack_frame({"op": "has", "id": 3, "keys": [stored[0], missing]}),  # not an mget: waits its turn
        pack_frame({"op": "mget", "id": 4, "keys": [stored[2], missing, "../etc/passwd", stored[3]]}),
        pack_frame({"op": "mget", "id": 8, "keys": [stored[4]]}),
        pack_frame({"op": "stat", "id": 9}),
    ]
    with socket.create_connection(server.address, timeout=10) as s:
        s.sendall(b"".join(frames))
        replies = read_replies(s, 9)
    ids = [r["id"] for r, _ in replies]
    assert ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    by_id = {r["id"]: (r, p) for r, p in replies}
    assert by_id[1][1] == block(0) and by_id[2][1] == block(1)
    assert by_id[3][0]["have"] == [True, False]
    assert by_id[4][1] == block(2) and by_id[7][1] == block(3) and by_id[8][1] == block(4)
    assert by_id[5][0]["err"] == "missing" and by_id[6][0]["err"] == "bad_key"
    assert by_id[9][0]["ok"] is True


def test_a_malformed_mget_behind_a_good_one_is_still_refused(server: StoreServer, stored: list[str]):
    with socket.create_connection(server.address, timeout=10) as s:
        s.sendall(pack_frame({"op": "mget", "id": 1, "keys": stored[:2]}) + pack_frame({"op": "mget", "id": 3, "keys": []}))
        replies = read_replies(s, 3)
        assert [r["ok"] for r, _ in replies] == [True, True, False]
        assert replies[2][0]["err"] == "bad_request"
        assert s.recv(1) == b""  # and the server hangs up, as without a look-ahead


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_files_opened_ahead_are_closed_when_the_client_goes_away(server: StoreServer, stored: list[str]):
    before = open_fds()
    for _ in range(5):
        s = socket.create_connection(server.address, timeout=10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the server blocks in the first batch
        s.sendall(pack_frame({"op": "mget", "id": 1, "keys": stored}) + pack_frame({"op": "mget", "id": 9, "keys": stored}))
        s.recv(1000)
        s.close()
    deadline = time.monotonic() + 10
    while open_fds() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert open_fds() <= before


def test_client_reads_through_the_look_ahead_byte_exact(server: StoreServer):
    keys = keys_for(300, seed=1000)
    with StoreClient([server.address], BB, window=16) as c:  # many refills, each one frame
        c.put_many([(k, block(i % 8)) for i, k in enumerate(keys)])
        out = bytearray(len(keys) * BB)
        c.get_many(keys, out)
        assert all(out[i * BB : (i + 1) * BB] == block(i % 8) for i in range(len(keys)))
