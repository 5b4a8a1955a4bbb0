"""The store client across a server crash: reads and writes retry within a bound, and a dead
link fails at once (issue 14, recovery)."""
from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from dualpath.store.client import StoreClient
from dualpath.store.errors import StoreConnectionError
import hashlib
from emulators.kvstore.launch import ServerProcess

BB = 4096


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keys(n: int) -> list[str]:
    return [hashlib.blake2b(f"retry-{i}".encode(), digest_size=16).hexdigest() for i in range(n)]


@pytest.fixture
def crashing(tmp_path: Path):
    port = _free_port()
    sp = ServerProcess(tmp_path / "s0", 1 << 26, listen=f"127.0.0.1:{port}", block_bytes=BB,
                       log_path=tmp_path / "s0.log")
    sp.start()
    yield sp
    sp.stop()


def _restart_after(sp: ServerProcess, delay_s: float) -> threading.Thread:
    def go():
        time.sleep(delay_s)
        sp.start()
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def test_reads_and_writes_retry_across_a_server_restart(crashing):
    keys = _keys(40)
    blocks = [os.urandom(BB) for _ in keys]
    with StoreClient([crashing.address_str], BB, retry_s=15) as c:
        c.put_many(list(zip(keys[:20], blocks[:20])))
        crashing.kill()  # SIGKILL: the crash
        t = _restart_after(crashing, 1.0)
        t0 = time.monotonic()
        out = bytearray(20 * BB)
        c.get_many(keys[:20], out)  # waits for the restart, then reads what was acknowledged
        assert time.monotonic() - t0 >= 0.9
        assert bytes(out) == b"".join(blocks[:20])
        t.join()
        crashing.kill()
        t = _restart_after(crashing, 1.0)
        assert c.put_many(list(zip(keys[20:], blocks[20:]))) == [True] * 20  # puts retry too
        t.join()
        assert c.contains(keys) == [True] * 40
        assert c.retries > 0


def test_a_server_that_stays_down_fails_within_the_bound(crashing):
    keys = _keys(4)
    with StoreClient([crashing.address_str], BB, retry_s=1.5) as c:
        c.put_many([(k, bytes(BB)) for k in keys])
        crashing.kill()
        t0 = time.monotonic()
        with pytest.raises(StoreConnectionError) as e:
            c.get_many(keys, bytearray(4 * BB))
        assert 1.4 <= time.monotonic() - t0 < 5
        assert set(e.value.errors) == set(keys)  # every key is named


def test_without_retry_a_crash_is_an_error_at_once(crashing):
    with StoreClient([crashing.address_str], BB) as c:
        c.put(_keys(1)[0], bytes(BB))
        crashing.kill()
        t0 = time.monotonic()
        with pytest.raises(StoreConnectionError):
            c.get(_keys(1)[0])
        assert time.monotonic() - t0 < 1


def test_a_dead_link_fails_at_once_and_interrupt_ends_a_stalled_read(crashing):
    up = [True]
    keys = _keys(2)
    with StoreClient([crashing.address_str], BB, retry_s=30, link_up=lambda: up[0], link_name="dpt-p0-snic") as c:
        c.put_many([(k, bytes(BB)) for k in keys])
        up[0] = False
        t0 = time.monotonic()
        with pytest.raises(StoreConnectionError, match="dpt-p0-snic is down") as e:
            c.get_many(keys, bytearray(2 * BB))
        assert time.monotonic() - t0 < 0.5 and set(e.value.errors) == set(keys)
    # a server that accepts and never answers: the read stalls until interrupt() cuts it
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    with StoreClient([f"127.0.0.1:{lsock.getsockname()[1]}"], BB, retry_s=30, link_up=lambda: up[0]) as c:
        up[0] = True
        threading.Timer(0.5, lambda: (up.__setitem__(0, False), c.interrupt())).start()
        t0 = time.monotonic()
        with pytest.raises(StoreConnectionError):
            c.get(keys[0])
        assert time.monotonic() - t0 < 3  # not the 30 s socket timeout, nor the retry bound
    lsock.close()
