"""Crash safety: SIGKILL a storage server mid-write, restart it on the same root.

Nothing half-written may ever become visible, every acknowledged block must
survive, and startup must remove the temp files the crash left behind. The
server runs as a real subprocess (python -m emulators.kvstore) on
127.0.0.1 with an ephemeral port; every process is killed in `finally`.
"""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dualpath.store import MissingBlockError, StoreClient, StoreError, chain_keys, is_valid_key
from dualpath.store.checksum import WRITE_ALGO, checksum
from dualpath.store.protocol import pack_frame
from emulators.kvstore.blockfile import TEMP_PREFIX
from emulators.kvstore.launch import ServerProcess

BB = 256 * 1024
CAPACITY = 1 << 30


def data(i: int) -> bytes:
    return np.random.default_rng(i).bytes(BB)


def temp_files(root: Path) -> list[Path]:
    return list((root / "blocks").glob(f"*/{TEMP_PREFIX}*"))


def wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


class Writer(threading.Thread):
    """Puts blocks one at a time and records each acknowledged key, until the server dies."""

    def __init__(self, addr, keys: list[str], index: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.addr, self.keys, self.index = addr, keys, index
        self.acked: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with StoreClient([self.addr], BB, timeout_s=10) as c:
                for k in self.keys:  # bounded by the key list
                    c.put(k, data(self.index[k]))
                    self.acked.append(k)
        except (StoreError, OSError) as exc:
            self.error = exc  # expected once the server is killed


def verify_after_restart(root: Path, addr, index: dict[str, int], acked: set[str], never: set[str]) -> int:
    assert temp_files(root) == [], "startup must remove stale temp files"
    on_disk = [p.name for p in (root / "blocks").glob("*/*")]
    assert all(is_valid_key(n) for n in on_disk), on_disk
    with StoreClient([addr], BB) as c:
        # Every visible block reads back whole, checksum verified by the client.
        visible = sorted(on_disk)
        out = bytearray(len(visible) * BB)
        c.get_many(visible, out)
        for j, k in enumerate(visible):
            assert out[j * BB : (j + 1) * BB] == data(index[k]), f"block {k} is not what was written"
        # Every acknowledged block survived.
        missing = acked - set(visible)
        assert not missing, f"acknowledged blocks lost: {sorted(missing)[:3]}"
        for k in never:
            assert c.contains([k]) == [False]
            with pytest.raises(MissingBlockError):
                c.get(k)
        st = c.stats()[0]
        assert st["blocks"] == len(visible) and st["reserved_bytes"] == 0
    return len(visible)


def test_sigkill_mid_write_then_restart(tmp_path: Path):
    root = tmp_path / "srv"
    keys = chain_keys(np.arange(4 * 600), 4)
    partial = chain_keys(np.arange(10**6, 10**6 + 4 * 3), 4)  # only ever half-sent
    planted = chain_keys(np.arange(2 * 10**6, 2 * 10**6 + 4), 4)[0]
    index = {k: i for i, k in enumerate(keys)}
    acked: set[str] = set()
    caught_mid_write = 0
    next_key = 0
    servers: list[ServerProcess] = []
    try:
        for cycle in range(3):
            srv = ServerProcess(root, CAPACITY)
            servers.append(srv)
            addr = srv.start()
            if cycle:
                verify_after_restart(root, addr, index, acked, set(partial) | {planted})
            # 1) a put stuck half way through its payload: its temp file is on disk at the kill
            half = socket.create_connection(addr, timeout=10)
            pkey = partial[cycle]
            payload = np.random.default_rng(7).bytes(BB)
            half.sendall(pack_frame({"op": "put", "id": 1, "key": pkey, "n": BB, "crc": checksum(payload), "algo": WRITE_ALGO}) + payload[: BB // 2])
            wait_for(lambda: any(pkey in p.name for p in temp_files(root)), 10, "the half-sent put's temp file")
            # 2) a writer streaming whole puts; kill while it is busy
            w = Writer(addr, keys[next_key:], index)
            w.start()
            target = 15
            wait_for(lambda: len(w.acked) >= target or not w.is_alive(), 30, "acknowledged puts")
            srv.kill()
            w.join(timeout=30)
            assert not w.is_alive()
            assert w.error is not None, "the writer should have seen the server die"
            half.close()
            acked.update(w.acked)
            next_key += len(w.acked) + 1  # the put in flight at the kill may or may not have landed
            leftovers = temp_files(root)
            assert any(pkey in p.name for p in leftovers), "the kill happened mid-write"
            caught_mid_write += 1
            if cycle == 2:
                # A stale temp file of a block never acknowledged, as a crash in fsync would leave.
                stale = root / "blocks" / planted[:2] / f"{TEMP_PREFIX}{planted}-999-0"
                stale.write_bytes(b"\0" * 100)
        srv = ServerProcess(root, CAPACITY)
        servers.append(srv)
        addr = srv.start()
        n_visible = verify_after_restart(root, addr, index, acked, set(partial) | {planted})
        assert n_visible >= len(acked) >= 3 * 15
        assert caught_mid_write == 3
    finally:
        for s in servers:
            s.kill()


def test_one_server_per_root(tmp_path: Path):
    root = tmp_path / "srv"
    a = ServerProcess(root, CAPACITY)
    b = ServerProcess(root, CAPACITY, startup_timeout_s=15)
    try:
        a.start()
        with pytest.raises(RuntimeError, match="exited"):
            b.start()
        assert "already uses root" in b.log_path.read_text()
    finally:
        b.kill()
        a.kill()
