"""Store server + client over loopback: put/get, striping, checksums, errors, concurrency.

Servers run in-process (threads) on 127.0.0.1 with ephemeral ports; the crash
test (test_store_crash.py) runs them as subprocesses.
"""
from __future__ import annotations

import errno
import os
import socket
import struct
import threading
from pathlib import Path

import msgpack
import numpy as np
import pytest

from dualpath.store import (
    BadKeyError,
    BadRequestError,
    CorruptBlockError,
    MissingBlockError,
    ServerBusyError,
    StoreClient,
    StoreFullError,
    StoreIOError,
    chain_keys,
    server_index,
)
from dualpath.store.protocol import pack_frame, recv_header
from emulators.kvstore import storage as storage_mod
from emulators.kvstore.blockfile import HEADER_SIZE
from emulators.kvstore.server import StoreServer
from tests.store_helpers import block_path, raw_request

BB = 64 * 1024  # block bytes for these tests


def block(i: int, bb: int = BB) -> bytes:
    return np.random.default_rng(i).bytes(bb)


def keys_for(n: int, seed: int = 0) -> list[str]:
    return chain_keys(np.arange(seed, seed + 4 * n), 4)


@pytest.fixture
def client(server: StoreServer):
    c = StoreClient([server.address], BB)
    try:
        yield c
    finally:
        c.close()


# ---- basics ---------------------------------------------------------------
def test_put_get_round_trip_and_idempotent_put(client: StoreClient, server: StoreServer):
    k = keys_for(1)[0]
    assert client.put(k, block(1)) is True
    assert bytes(client.get(k)) == block(1)
    assert client.put(k, block(1)) is False  # already stored: acknowledged, not rewritten
    st = client.stats()[0]
    assert st["blocks"] == 1 and st["used_bytes"] == HEADER_SIZE + BB and st["reserved_bytes"] == 0
    assert client.contains([k, keys_for(1, seed=99)[0]]) == [True, False]
    # On disk: exactly one file under its key, no temp files.
    names = [p.name for p in server.store.blocks_dir.rglob("*") if p.is_file()]
    assert names == [k]


def test_put_rejects_wrong_block_size(client: StoreClient):
    with pytest.raises(BadRequestError):
        client.put(keys_for(1)[0], b"x" * (BB - 1))


def test_delete(client: StoreClient):
    k = keys_for(1)[0]
    client.put(k, block(2))
    assert client.delete(k) is True
    assert client.delete(k) is False
    with pytest.raises(MissingBlockError):
        client.get(k)
    assert client.stats()[0]["used_bytes"] == 0


# ---- striping -------------------------------------------------------------
def test_striping_spreads_over_servers_and_get_many_finds_them(make_server):
    servers = [make_server(f"s{i}") for i in range(3)]
    keys = keys_for(60)
    with StoreClient([s.address for s in servers], BB) as c:
        c.put_many([(k, block(i)) for i, k in enumerate(keys)])
        per_server = [s["blocks"] for s in c.stats()]
        assert sum(per_server) == 60 and min(per_server) >= 8
        for k in keys:  # each block lives exactly where the stripe function says
            for i, s in enumerate(servers):
                assert block_path(s, k).exists() == (server_index(k, 3) == i)
        out = bytearray(60 * BB)
        c.get_many(keys, out)
        assert all(out[i * BB : (i + 1) * BB] == block(i) for i in range(60))


# ---- get_many into a caller's buffer --------------------------------------
def test_get_many_into_numpy_buffer_at_offsets_is_byte_exact(make_server):
    servers = [make_server("a"), make_server("b")]
    keys = keys_for(20)
    with StoreClient([s.address for s in servers], BB, window=4) as c:  # small window: many refills
        c.put_many([(k, block(i)) for i, k in enumerate(keys)])
        # A "registered" buffer with gaps and a permuted placement.
        gap = 4096
        buf = np.full(20 * (BB + gap) + gap, 0xAB, dtype=np.uint8)
        order = list(reversed(range(20)))
        offsets = [gap + j * (BB + gap) for j in range(20)]
        c.get_many([keys[i] for i in order], buf, offsets)
        for j, i in enumerate(order):
            assert buf[offsets[j] : offsets[j] + BB].tobytes() == block(i)
        # Gaps untouched: nothing was written outside the blocks.
        assert (buf[:gap] == 0xAB).all() and all((buf[o + BB : o + BB + gap] == 0xAB).all() for o in offsets)
        # A memoryview slice of a bytearray works too, duplicates allowed.
        ba = bytearray(3 * BB)
        c.get_many([keys[5], keys[5], keys[7]], memoryview(ba))
        assert ba == block(5) + block(5) + block(7)


def test_get_many_rejects_bad_buffers(client: StoreClient):
    k = keys_for(2)
    with pytest.raises(ValueError):
        client.get_many(k, bytearray(BB))  # too small
    with pytest.raises(ValueError):
        client.get_many(k, bytes(2 * BB))  # read-only
    with pytest.raises(ValueError):
        client.get_many(k, bytearray(3 * BB), [0, BB // 2])  # overlapping


# ---- errors ---------------------------------------------------------------
def test_missing_block_is_a_typed_error_and_others_still_arrive(client: StoreClient):
    keys = keys_for(3)
    client.put(keys[0], block(0))
    client.put(keys[2], block(2))
    out = bytearray(3 * BB)
    with pytest.raises(MissingBlockError) as ei:
        client.get_many(keys, out)
    assert ei.value.key == keys[1] and keys[1] in str(ei.value)
    assert set(ei.value.errors) == {keys[1]}
    assert out[:BB] == block(0) and out[2 * BB :] == block(2)
    assert bytes(client.get(keys[0])) == block(0)  # connection still usable


@pytest.mark.parametrize("crc_threads", [0, 1], ids=["crc-inline", "crc-thread"])
def test_corrupted_payload_is_detected_naming_the_key(server: StoreServer, crc_threads: int):
    client = StoreClient([server.address], BB, crc_threads=crc_threads)
    keys = keys_for(2)
    client.put_many([(k, block(i)) for i, k in enumerate(keys)])
    p = block_path(server, keys[1])
    raw = bytearray(p.read_bytes())
    raw[HEADER_SIZE + 1234] ^= 0x01  # flip one bit of the payload on disk
    p.write_bytes(raw)
    with pytest.raises(CorruptBlockError) as ei:
        client.get(keys[1])
    assert ei.value.key == keys[1] and keys[1] in str(ei.value)
    out = bytearray(2 * BB)
    with pytest.raises(CorruptBlockError) as ei:
        client.get_many(keys, out)
    assert set(ei.value.errors) == {keys[1]}
    assert out[:BB] == block(0)
    assert bytes(client.get(keys[0])) == block(0)
    client.close()


def test_server_side_verification_reports_corruption(make_server):
    srv = make_server(verify_reads=True)
    k = keys_for(1)[0]
    with StoreClient([srv.address], BB) as c:
        c.put(k, block(3))
        p = block_path(srv, k)
        raw = bytearray(p.read_bytes())
        raw[-1] ^= 0xFF
        p.write_bytes(raw)
        reply = raw_request(srv.address, {"op": "get", "id": 1, "key": k})
        assert reply["ok"] is False and reply["err"] == "corrupt" and reply["key"] == k
        with pytest.raises(CorruptBlockError, match=k):
            c.get(k)


@pytest.mark.parametrize("where", ["header_len", "key", "truncated"])
def test_damaged_header_or_size_is_corruption(client: StoreClient, server: StoreServer, where: str):
    k = keys_for(1)[0]
    client.put(k, block(4))
    p = block_path(server, k)
    raw = bytearray(p.read_bytes())
    if where == "header_len":
        raw[8] ^= 0x10
    elif where == "key":
        raw[16] ^= 0x01
    else:
        raw = raw[:-100]
    p.write_bytes(raw)
    with pytest.raises(CorruptBlockError) as ei:
        client.get(k)
    assert ei.value.key == k


def test_bad_keys_rejected_by_client_and_server(client: StoreClient, server: StoreServer, tmp_path: Path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * BB)
    for bad in ["../../etc/passwd", "../secret", "/etc/passwd", ".tmp-x"]:
        with pytest.raises(BadKeyError):
            client.get(bad)
        with pytest.raises(BadKeyError):
            client.put(bad, block(0))
        # Bypass the client's own check: the server must refuse too, and keep serving.
        for req, payload in (({"op": "get", "id": 7, "key": bad}, b""), ({"op": "put", "id": 8, "key": bad, "n": 16, "crc": 0, "algo": 2}, b"y" * 16)):
            reply = raw_request(server.address, req, payload)
            assert reply["ok"] is False and reply["err"] == "bad_key"
    assert not list(server.store.root.rglob("passwd"))
    k = keys_for(1)[0]
    client.put(k, block(5))
    assert bytes(client.get(k)) == block(5)


def test_a_symlink_in_the_store_is_not_followed(client: StoreClient, server: StoreServer, tmp_path: Path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"z" * (HEADER_SIZE + BB))
    k = keys_for(1, seed=77)[0]
    block_path(server, k).symlink_to(outside)
    with pytest.raises(StoreIOError, match=k):
        client.get(k)
    assert bytes(client.get(keys_for(1)[0]) if client.put(keys_for(1)[0], block(1)) else b"") == block(1)


def test_capacity_exceeded_is_a_clear_error(make_server):
    srv = make_server(capacity=3 * (HEADER_SIZE + BB))
    keys = keys_for(5)
    with StoreClient([srv.address], BB) as c:
        c.put_many([(k, block(i)) for i, k in enumerate(keys[:3])])
        with pytest.raises(StoreFullError, match="capacity") as ei:
            c.put(keys[3], block(3))
        assert ei.value.key == keys[3]
        st = c.stats()[0]
        assert st["blocks"] == 3 and st["reserved_bytes"] == 0
        assert c.put(keys[0], block(0)) is False  # an existing block is still acknowledged
        c.delete(keys[0])
        assert c.put(keys[3], block(3)) is True  # space freed, space usable
        assert not list(srv.store.blocks_dir.rglob(".tmp-*"))


def test_disk_full_is_a_clear_error_and_leaves_nothing(client: StoreClient, server: StoreServer, monkeypatch):
    real_write = os.write
    calls = {"n": 0}

    def failing_write(fd, data):
        calls["n"] += 1
        if calls["n"] > 1:  # let the header through, fail in the payload
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(storage_mod.os, "write", failing_write)
    k = keys_for(1)[0]
    with pytest.raises(StoreFullError, match="disk full") as ei:
        client.put(k, block(6))
    assert ei.value.key == k
    monkeypatch.setattr(storage_mod.os, "write", real_write)
    assert not list(server.store.blocks_dir.rglob(".tmp-*"))
    assert client.stats()[0]["reserved_bytes"] == 0
    with pytest.raises(MissingBlockError):
        client.get(k)
    assert client.put(k, block(6)) is True


def test_payload_damaged_on_the_way_in_is_refused(server: StoreServer):
    k = keys_for(1)[0]
    data = block(7)
    reply = raw_request(server.address, {"op": "put", "id": 1, "key": k, "n": len(data), "crc": 12345, "algo": 2}, data)
    assert reply["ok"] is False and reply["err"] == "corrupt" and reply["key"] == k
    assert not server.store.has(k)


def test_malformed_frames_cost_only_their_connection(client: StoreClient, server: StoreServer):
    for junk in (struct.pack(">I", 1 << 30), struct.pack(">I", 3) + b"\xc1\xc1\xc1", struct.pack(">I", 1) + b"\x05"):
        with socket.create_connection(server.address, timeout=10) as s:
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            # The server says why in one error frame, then hangs up on this connection, and only on it.
            reply = recv_header(s)
            assert reply is not None and reply["ok"] is False and reply["err"] == "protocol" and reply["id"] == -1
            assert "\n" not in reply["msg"] and len(reply["msg"]) < 200
            assert s.recv(1 << 16) == b""
    reply = raw_request(server.address, {"op": "nope", "id": 3})
    assert reply["err"] == "bad_request"
    reply = raw_request(server.address, {"op": "put", "id": 4, "key": keys_for(1)[0], "n": 1 << 40, "crc": 0, "algo": 2})
    assert reply["err"] == "bad_request"
    k = keys_for(1)[0]
    client.put(k, block(8))
    assert bytes(client.get(k)) == block(8)


def test_connection_limit_gives_busy(make_server):
    srv = make_server(max_conns=2)
    k = keys_for(1)[0]
    c1, c2, c3 = (StoreClient([srv.address], BB) for _ in range(3))
    try:
        c1.put(k, block(9))
        c2.get(k)
        with pytest.raises(ServerBusyError):
            c3.get(k)
        c1.close()  # a slot frees up once the server notices
        for _ in range(200):  # bounded
            try:
                assert bytes(c3.get(k)) == block(9)
                break
            except ServerBusyError:
                threading.Event().wait(0.02)
        else:
            pytest.fail("slot never freed")
    finally:
        for c in (c1, c2, c3):
            c.close()


# ---- concurrency ----------------------------------------------------------
def test_concurrent_clients(make_server):
    servers = [make_server("x"), make_server("y")]
    addrs = [s.address for s in servers]
    shared = keys_for(8, seed=1000)  # every client writes these too: idempotent under races
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            own = keys_for(10, seed=10_000 * (t + 1))
            with StoreClient(addrs, BB, window=3) as c:
                c.put_many([(k, block(1000 + i)) for i, k in enumerate(shared)])
                c.put_many([(k, block(t * 100 + i)) for i, k in enumerate(own)])
                out = np.empty(18 * BB, dtype=np.uint8)
                for _ in range(3):
                    c.get_many(own + shared, out)
                    for i in range(10):
                        assert out[i * BB : (i + 1) * BB].tobytes() == block(t * 100 + i)
                    for i in range(8):
                        assert out[(10 + i) * BB : (11 + i) * BB].tobytes() == block(1000 + i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads)
    assert not errors, errors
    with StoreClient(addrs, BB) as c:
        st = c.stats()
        assert sum(s["blocks"] for s in st) == 8 + 6 * 10
        assert all(s["reserved_bytes"] == 0 for s in st)
        assert sum(s["used_bytes"] for s in st) == (8 + 60) * (HEADER_SIZE + BB)


def test_protocol_uses_msgpack_headers_not_pickle():
    frame = pack_frame({"op": "get", "id": 1, "key": "0" * 32})
    (n,) = struct.unpack(">I", frame[:4])
    assert msgpack.unpackb(frame[4 : 4 + n]) == {"op": "get", "id": 1, "key": "0" * 32}
