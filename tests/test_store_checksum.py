"""Block checksums: CRC-32C for new blocks, CRC-32 blocks of older roots still read and checked.

Servers run in-process (threads) on 127.0.0.1 with ephemeral ports.
"""
from __future__ import annotations

import socket
import struct
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

from dualpath.store import CorruptBlockError, ProtocolError, StoreClient, chain_keys
from dualpath.store.checksum import ALGO_CRC32, ALGO_CRC32C, WRITE_ALGO, checksum
from dualpath.store.protocol import pack_frame, recv_header
from emulators.kvstore.blockfile import HEADER_SIZE, decode_header, encode_header
from emulators.kvstore.server import StoreServer
from tests.store_helpers import block_path, raw_request

BB = 64 * 1024


def block(i: int) -> bytes:
    return np.random.default_rng(100 + i).bytes(BB)


def keys_for(n: int, seed: int = 0) -> list[str]:
    return chain_keys(np.arange(seed, seed + 4 * n), 4, namespace=b"checksum-tests")


def test_checksum_algorithms_are_the_standard_ones():
    # Check values of the catalogue of CRC algorithms (input "123456789").
    assert checksum(b"123456789", ALGO_CRC32C) == 0xE3069283
    assert checksum(b"123456789", ALGO_CRC32) == 0xCBF43926
    data = block(0)
    assert checksum(data[1000:], ALGO_CRC32C, checksum(data[:1000], ALGO_CRC32C)) == checksum(data)  # incremental
    assert checksum(memoryview(bytearray(data))) == checksum(data)
    with pytest.raises(ValueError):
        checksum(data, 3)


def test_new_blocks_are_stored_with_crc32c(server: StoreServer):
    k = keys_for(1)[0]
    with StoreClient([server.address], BB) as c:
        c.put(k, block(1))
    raw = block_path(server, k).read_bytes()
    h = decode_header(raw[:HEADER_SIZE], k)
    assert h.algo == ALGO_CRC32C == WRITE_ALGO
    assert h.payload_crc == checksum(raw[HEADER_SIZE:], ALGO_CRC32C) != zlib.crc32(raw[HEADER_SIZE:])


def plant_crc32_block(srv: StoreServer, key: str, payload: bytes) -> Path:
    """A block file as the store wrote it before CRC-32C (algo 1)."""
    p = block_path(srv, key)
    p.write_bytes(encode_header(key, len(payload), zlib.crc32(payload), ALGO_CRC32) + payload)
    return p


@pytest.mark.parametrize("crc_threads", [0, 1], ids=["crc-inline", "crc-thread"])
def test_crc32_blocks_of_an_older_root_are_read_and_checked(server: StoreServer, crc_threads: int):
    old, new = keys_for(2)
    plant_crc32_block(server, old, block(2))
    with StoreClient([server.address], BB, crc_threads=crc_threads) as c:
        c.put(new, block(3))
        out = bytearray(2 * BB)
        c.get_many([old, new], out)  # one batch mixing both algorithms
        assert out == block(2) + block(3)
        # A flipped bit in an old block is still caught, with CRC-32.
        p = block_path(server, old)
        raw = bytearray(p.read_bytes())
        raw[HEADER_SIZE + 77] ^= 0x04
        p.write_bytes(raw)
        with pytest.raises(CorruptBlockError) as ei:
            c.get_many([old, new], out)
        assert set(ei.value.errors) == {old}
        assert out[BB:] == block(3)


def test_server_side_verification_uses_the_block_algorithm(tmp_path: Path):
    srv = StoreServer(tmp_path / "v", 1 << 30, ("127.0.0.1", 0), verify_reads=True)
    srv.start()
    try:
        old, new = keys_for(2, seed=40)
        plant_crc32_block(srv, old, block(4))
        with StoreClient([srv.address], BB) as c:
            c.put(new, block(5))
            assert bytes(c.get(old)) == block(4) and bytes(c.get(new)) == block(5)
    finally:
        srv.stop()


def test_unknown_algo_in_a_header_is_corruption(server: StoreServer):
    k = keys_for(1, seed=50)[0]
    payload = block(6)
    # A well-formed header (its own CRC is right) naming an algorithm this store does not know.
    head = bytearray(encode_header(k, len(payload), 0, ALGO_CRC32C))
    head[5] = 9
    struct.pack_into("<I", head, 36, zlib.crc32(bytes(head[:36])))
    block_path(server, k).write_bytes(bytes(head) + payload)
    with StoreClient([server.address], BB) as c, pytest.raises(CorruptBlockError, match="algo 9"):
        c.get(k)


@pytest.mark.parametrize("algo", [None, ALGO_CRC32, True, 9], ids=["v1-client", "crc32", "bool", "unknown"])
def test_a_put_must_be_crc32c(server: StoreServer, algo):
    k = keys_for(1, seed=60)[0]
    data = block(7)
    header = {"op": "put", "id": 1, "key": k, "n": len(data), "crc": zlib.crc32(data)}
    if algo is not None:
        header["algo"] = algo
    reply = raw_request(server.address, header, data)
    assert reply["ok"] is False and reply["err"] == "bad_request" and "CRC-32C" in reply["msg"]
    assert not server.store.has(k)
    with StoreClient([server.address], BB) as c:  # the connection was consumed in sync; the server still serves
        assert c.put(k, data) is True


def test_a_reply_without_algo_is_refused_not_read_unchecked():
    """A server of protocol v1 names no algorithm: the client must not guess one."""
    k = keys_for(1, seed=70)[0]
    payload = block(8)
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.settimeout(10)

    def serve_v1() -> None:
        conn, _ = lsock.accept()
        with conn:
            req = recv_header(conn)
            assert req is not None
            rid = req["id"]
            conn.sendall(pack_frame({"id": rid, "ok": True, "n": BB, "crc": zlib.crc32(payload)}) + payload)
            try:
                conn.recv(1)  # until the client hangs up (a reset, since it left the payload unread)
            except OSError:
                pass

    th = threading.Thread(target=serve_v1, daemon=True)
    th.start()
    try:
        with StoreClient([lsock.getsockname()], BB, crc_threads=0) as c, pytest.raises(ProtocolError, match="algo"):
            c.get(k)
    finally:
        th.join(10)
        lsock.close()


def test_header_encoder_refuses_unknown_algo():
    with pytest.raises(ValueError):
        encode_header(keys_for(1)[0], 1, 0, 7)
