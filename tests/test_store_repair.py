"""Damaged blocks: detected by has/contains (cheaply or with verify), reported by reads with
the key, and repaired by a put of the right bytes.

Servers run in-process (threads) on 127.0.0.1 with ephemeral ports.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from dualpath.store import CorruptBlockError, StoreClient, chain_keys
from emulators.kvstore.blockfile import HEADER_SIZE
from emulators.kvstore.server import StoreServer
from tests.store_helpers import block_path, raw_request

BB = 64 * 1024


def block(i: int) -> bytes:
    return np.random.default_rng(700 + i).bytes(BB)


def keys_for(n: int, seed: int = 0) -> list[str]:
    return chain_keys(np.arange(seed, seed + 4 * n), 4, namespace=b"repair-tests")


def damage(srv: StoreServer, key: str, where: str) -> None:
    p = block_path(srv, key)
    raw = bytearray(p.read_bytes())
    if where == "payload":
        raw[HEADER_SIZE + 4321] ^= 0x04  # one bit of the payload
    elif where == "header":
        raw[33] ^= 0x01  # the payload CRC field: the header CRC no longer matches
    elif where == "truncated":
        raw = raw[: HEADER_SIZE + BB // 2]
    p.write_bytes(raw)


@pytest.mark.parametrize("where", ["payload", "header", "truncated"])
def test_a_put_of_the_right_bytes_repairs_a_damaged_block(server: StoreServer, where: str):
    keys = keys_for(2)
    with StoreClient([server.address], BB) as c:
        c.put_many([(k, block(i)) for i, k in enumerate(keys)])
        before = c.stats()[0]
        damage(server, keys[1], where)
        with pytest.raises(CorruptBlockError) as ei:
            c.get_many(keys, bytearray(2 * BB))
        assert ei.value.key == keys[1] and set(ei.value.errors) == {keys[1]}  # a caller can fall back
        assert c.put_status([(keys[0], block(0)), (keys[1], block(1))]) == ["exists", "repaired"]
        assert bytes(c.get(keys[1])) == block(1)
        st = c.stats()[0]
        assert (st["blocks"], st["used_bytes"], st["reserved_bytes"]) == (before["blocks"], before["used_bytes"], 0)
        assert c.put(keys[1], block(1)) is False  # intact now: nothing to do
        assert c.contains(keys, verify=True) == [True, True]
    assert not list(server.store.blocks_dir.rglob(".tmp-*"))


def test_the_put_reply_says_repaired(server: StoreServer):
    from dualpath.store.checksum import WRITE_ALGO, checksum

    k = keys_for(1, seed=10)[0]
    with StoreClient([server.address], BB) as c:
        c.put(k, block(5))
    damage(server, k, "payload")
    head = {"op": "put", "id": 1, "key": k, "n": BB, "crc": checksum(block(5)), "algo": WRITE_ALGO}
    reply = raw_request(server.address, head, block(5))
    assert reply["ok"] is True and reply["repaired"] is True and reply["new"] is False
    reply = raw_request(server.address, {**head, "id": 2}, block(5))
    assert reply["ok"] is True and reply["repaired"] is False and reply["new"] is False


def test_has_checks_header_and_size_cheaply_and_the_payload_with_verify(server: StoreServer):
    keys = keys_for(3, seed=20)
    with StoreClient([server.address], BB) as c:
        c.put_many([(k, block(i)) for i, k in enumerate(keys)])
        damage(server, keys[0], "payload")
        damage(server, keys[1], "header")
        damage(server, keys[2], "truncated")
        # The cheap check reads 64 bytes per key: it cannot see a flipped payload bit ...
        assert c.contains(keys) == [True, False, False]
        # ... verify reads the payloads and sees every kind of damage.
        assert c.contains(keys, verify=True) == [False, False, False]
        assert server.store.has(keys[0]) and not server.store.has(keys[0], verify=True)


def test_a_damaged_payload_is_still_refused_not_stored(server: StoreServer):
    """A repair never stores bytes that fail their own CRC."""
    k = keys_for(1, seed=30)[0]
    with StoreClient([server.address], BB) as c:
        c.put(k, block(7))
    damage(server, k, "payload")
    reply = raw_request(server.address, {"op": "put", "id": 1, "key": k, "n": BB, "crc": 12345, "algo": 2}, block(7))
    assert reply["ok"] is False and reply["err"] == "corrupt"
    assert not server.store.has(k, verify=True)  # still damaged, still detected


def test_concurrent_repairs_and_deletes_keep_the_accounting_exact(server: StoreServer):
    keys = keys_for(6, seed=40)
    with StoreClient([server.address], BB) as c:
        c.put_many([(k, block(i)) for i, k in enumerate(keys)])
    for k in keys:
        damage(server, k, "payload")
    errors: list[BaseException] = []

    def repair() -> None:
        try:
            with StoreClient([server.address], BB) as c:
                c.put_many([(k, block(i)) for i, k in enumerate(keys)])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=repair) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors, errors
    with StoreClient([server.address], BB) as c:
        out = bytearray(len(keys) * BB)
        c.get_many(keys, out)
        assert all(out[i * BB : (i + 1) * BB] == block(i) for i in range(len(keys)))
        st = c.stats()[0]
        assert st["blocks"] == len(keys) and st["used_bytes"] == len(keys) * (HEADER_SIZE + BB)
        assert st["reserved_bytes"] == 0
        c.delete(keys[0])
        assert c.stats()[0]["blocks"] == len(keys) - 1
