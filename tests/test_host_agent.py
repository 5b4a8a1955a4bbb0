"""The host agent's control calls as a class (dualpath/nodes/host.py HostAgent), against a real
store server on loopback: no namespaces, no root. What a flush persists and what a load reads
back are the agent's own rules: a block is persisted only once the bytes in the buffer match the
writer's CRC, and a load names the first block it could not read."""
from __future__ import annotations

import numpy as np
import pytest

from dualpath.kv.check import crc
from dualpath.nodes.host import HostAgent
from dualpath.store import StoreClient, chain_keys
from tests.store_helpers import make_server, server  # noqa: F401  (fixtures)

FB = 4096


class NoNotifications:
    """The agent's notification waiter is NIXL's; these calls never wait on one."""

    def close(self) -> None:
        pass


@pytest.fixture
def host(server):  # noqa: F811
    buf = np.zeros(8 * FB, dtype=np.uint8)
    store, writes = StoreClient([server.address], FB), StoreClient([server.address], FB)
    agent = HostAgent(buf, FB, store, writes, NoNotifications())
    yield agent, buf
    agent.close()


def test_a_flush_persists_what_landed_and_a_load_reads_it_back(host):
    agent, buf = host
    keys = chain_keys(np.arange(3 * 16, dtype=np.int64), 16, namespace=b"host-agent-test")
    blocks = [np.random.default_rng(i).integers(0, 256, FB, dtype=np.uint8) for i in range(3)]
    for i, b in enumerate(blocks):
        buf[i * FB:(i + 1) * FB] = b
    out = agent.flush(keys, 0, [crc(b) for b in blocks], timeout_s=5.0)
    assert out["stored"] == [True, True, True] and out["new"] == 3 and out["errors"] == {}
    assert agent.contains(keys)["present"] == [True, True, True]
    buf[:] = 0
    got = agent.load(keys, 4 * FB)
    assert got["failed_at"] == -1 and got["bytes"] == 3 * FB
    for i, b in enumerate(blocks):
        assert np.array_equal(buf[(4 + i) * FB:(5 + i) * FB], b)


def test_a_block_whose_bytes_never_match_the_writers_crc_is_not_persisted(host):
    agent, buf = host
    keys = chain_keys(np.arange(16, dtype=np.int64), 16, namespace=b"host-agent-stale")
    buf[:FB] = 7
    with pytest.raises(RuntimeError, match="never landed intact"):
        agent.flush(keys, 0, [crc(np.full(FB, 8, dtype=np.uint8))], timeout_s=0.05)
    assert agent.contains(keys)["present"] == [False]


def test_a_load_of_a_missing_block_names_it(host):
    agent, _ = host
    keys = chain_keys(np.arange(2 * 16, dtype=np.int64), 16, namespace=b"host-agent-missing")
    got = agent.load(keys, 0)
    assert got["failed_at"] == 0 and keys[0] in got["errors"]


def test_arguments_are_taken_as_sent(host):
    agent, _ = host
    with pytest.raises(Exception, match="valid integer"):
        agent.load(["k"], "0")


def test_the_agent_owns_its_buffer_areas_and_an_earlier_epochs_free_frees_nothing(host):
    agent, _ = host
    a = agent.alloc(3 * FB)
    b = agent.alloc(5 * FB)
    assert (a["offset"], b["offset"]) == (0, 3 * FB) and a["epoch"] == agent.epoch
    full = agent.alloc(FB)  # 8 blocks, all taken: no room, said, not raised
    assert full["offset"] is None and "no room" in full["error"]
    assert agent.free(a["offset"], "another-process")["freed"] is False  # a restarted agent's
    assert agent.alloc(FB)["offset"] is None  # ... freed nothing
    assert agent.free(a["offset"], agent.epoch)["freed"] is True
    assert agent.alloc(2 * FB)["offset"] == 0
    with pytest.raises(ValueError, match="no area of this buffer starts at 64"):
        agent.free(64, agent.epoch)
    with pytest.raises(ValueError, match="field 'nbytes'"):
        agent.alloc(9 * FB)
