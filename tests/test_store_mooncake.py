"""Mooncake Store as the testbed's second store, on loopback: a storage host (mooncake_master and
a DRAM segment, emulators/mooncake_store.py) and the host agents' client (dualpath/store/mooncake.py):
byte-exact Full Blocks at any offset of the registered buffer, "new" reported as the 3FS-like
store's client reports it, failures named by block, and nothing left running after a stop or a
crash. A topology takes `store: mooncake`; faults on it are refused. No root needed."""
from __future__ import annotations

import importlib.util
import time

import numpy as np
import psutil
import pytest

from dualpath.store.errors import BadRequestError, MissingBlockError
from emulators.kvstore.launch import ServerProcess
from testbed.topology import TopologyError, load_topology
from tests.conftest import REPO

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                                reason="the Mooncake wheel is not installed")
FB = 64 << 10  # one Full Block
KEYS = [f"{i:032x}" for i in range(6)]


def _server(tmp_path) -> ServerProcess:
    return ServerProcess(tmp_path / "s0", 64 << 20, listen="127.0.0.1:0", module="emulators.mooncake_store",
                         log_path=tmp_path / "s0.log")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from dualpath.store.mooncake import MooncakeStoreClient

    sp = _server(tmp_path_factory.mktemp("mcs"))
    sp.start()
    buf = np.zeros(16 * FB, np.uint8)
    buf[:6 * FB] = np.random.default_rng(3).integers(0, 256, 6 * FB, dtype=np.uint8)
    client = MooncakeStoreClient(sp.address_str, FB, "127.0.0.1", buf)
    yield client, buf
    client.close()
    sp.stop()


def test_blocks_round_trip_byte_exact_at_any_offset(store):
    client, buf = store
    view = memoryview(buf)
    items = [(k, view[i * FB:(i + 1) * FB]) for i, k in enumerate(KEYS)]
    assert client.put_many(items) == [True] * 6
    assert client.put_many(items[:2]) == [False, False]  # stored already: not new, as the 3FS-like client says
    assert client.contains(KEYS + ["f" * 32]) == [True] * 6 + [False]
    offsets = [15 * FB, 8 * FB, 11 * FB, 9 * FB, 13 * FB, 10 * FB]  # scattered, out of order
    client.get_many(KEYS, view, offsets)
    for i, off in enumerate(offsets):
        assert np.array_equal(buf[off:off + FB], buf[i * FB:(i + 1) * FB]), i


def test_failures_name_the_block(store):
    client, buf = store
    view = memoryview(buf)
    with pytest.raises(MissingBlockError) as e:
        client.get_many([KEYS[0], "e" * 32], view, [7 * FB, 8 * FB])
    assert list(e.value.errors) == ["e" * 32]  # the block that is there was read
    with pytest.raises(BadRequestError, match="store blocks are"):
        client.put_many([(KEYS[0], view[:FB - 1])])
    with pytest.raises(BadRequestError, match="outside the registered buffer"):
        client.put_many([(KEYS[0], memoryview(bytearray(FB)))])


def test_a_stop_or_a_crash_leaves_no_master(tmp_path):
    for end in ("stop", "kill"):
        sp = _server(tmp_path / end)
        sp.start()
        master = psutil.Process(sp.proc.pid).children()
        assert [p.name() for p in master] == ["mooncake_master"]
        getattr(sp, end)()
        deadline = time.monotonic() + 10
        while master[0].is_running() and master[0].status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not master[0].is_running() or master[0].status() == psutil.STATUS_ZOMBIE, end


def test_a_topology_names_its_store(tmp_path):
    assert load_topology(REPO / "topologies" / "1p1d-io-mooncake.yaml").spec.store == "mooncake"
    assert load_topology(REPO / "topologies" / "1p1d-io.yaml").spec.store == "3fs-like"
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "topologies" / "1p1d-io-mooncake.yaml").read_text().replace("store: mooncake", "store: redis"))
    with pytest.raises(TopologyError, match="store"):
        load_topology(bad)
