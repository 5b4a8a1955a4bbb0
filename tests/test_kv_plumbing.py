"""The pieces between engine and transport: descriptor lists, allocators, the control plane."""
import subprocess
import sys

import numpy as np
import pytest
import torch
import zmq
from hypothesis import given, settings, strategies as st

from dualpath.kv.buffers import ByteAllocator, OutOfSpace
from dualpath.control import ControlError, RpcClient, pack, unpack
from dualpath.kv.spans import token_rows_descs
from dualpath.kv.layouts import BlockGeometry, full_block_view, pack_rows

GEOM = BlockGeometry(n_layer=3, block_size=4, n_kv_heads=2, head_dim=2, dtype=torch.float32)


@given(first=st.integers(0, 40), n=st.integers(1, 40), layer=st.integers(0, 2))
@settings(max_examples=60, deadline=None)
def test_token_rows_move_exactly_the_right_bytes(first, n, layer):
    """Moving rows with the descriptors equals slicing the Full-Block layout by hand."""
    g = GEOM
    n_blocks = g.blocks_spanned(first + n)
    remote = np.random.default_rng(first * 100 + n).integers(0, 255, n_blocks * g.full_block_bytes, dtype=np.uint8)
    local = np.zeros(n * g.bytes_per_token_per_layer, dtype=np.uint8)
    descs = token_rows_descs(g, layer, first, n, 0, 0)
    for lo, ro, ln in descs:
        local[lo:lo + ln] = remote[ro:ro + ln]
    blocks = [full_block_view(remote, g, b * g.full_block_bytes) for b in range(n_blocks)]
    want = torch.cat([b[layer] for b in blocks])[first:first + n].numpy().reshape(-1)
    assert np.array_equal(local, want)
    assert int(descs[:, 2].sum()) == n * g.bytes_per_token_per_layer
    # one descriptor per Full Block touched: the per-layer batch
    assert len(descs) == (first + n - 1) // g.block_size - first // g.block_size + 1


def test_pack_rows_round_trips():
    k = torch.randn(5, 2, 2)
    v = torch.randn(5, 2, 2)
    rows = torch.empty((5, GEOM.bytes_per_token_per_layer), dtype=torch.uint8)
    pack_rows(k, v, GEOM, rows)
    kv = rows.view(torch.float32).view(5, 2, 2, 2)
    assert torch.equal(kv[:, 0], k) and torch.equal(kv[:, 1], v)


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5000)), max_size=60))
@settings(max_examples=80, deadline=None)
def test_allocator_never_overlaps_and_reuses_freed_space(ops):
    a = ByteAllocator(64 * 1024, "t")
    live: dict[int, int] = {}
    for do_free, n in ops:
        if do_free and live:
            off = sorted(live)[n % len(live)]
            a.free(off)
            del live[off]
            continue
        try:
            off = a.alloc(n)
        except OutOfSpace:
            continue
        assert 0 <= off and off + n <= a.capacity
        for o, s in live.items():
            assert off + n <= o or o + s <= off, "overlapping allocations"
        live[off] = n
    for off in list(live):
        a.free(off)
    assert a.in_use == 0 and a.alloc(64 * 1024) == 0  # everything coalesced back


def test_allocator_errors():
    a = ByteAllocator(1024, "hbm")
    with pytest.raises(OutOfSpace, match="hbm: no room"):
        a.alloc(2048)
    with pytest.raises(ValueError):
        a.alloc(0)


# -- control plane -------------------------------------------------------------------------

SERVER = r"""
import sys
from dualpath.control import RpcServer
def add(a: int, b: int) -> dict:
    return {"sum": a + b}
def boom() -> dict:
    raise RuntimeError("kaput")
def shutdown() -> dict:
    return {"shutdown": True}
s = RpcServer(sys.argv[1], {"add": add, "boom": boom, "shutdown": shutdown})
print("ready", flush=True)
s.serve(max_seconds=60)
"""


@pytest.fixture
def rpc_server():
    ctx = zmq.Context()
    probe = ctx.socket(zmq.REP)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close()
    ctx.term()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, f"tcp://127.0.0.1:{port}"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("ready")
    yield proc, f"tcp://127.0.0.1:{port}"
    proc.kill()
    proc.wait()


def _call(endpoint: str, payload: bytes) -> dict:
    ctx = zmq.Context()
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    s.send(payload)
    assert s.poll(5000), "no reply"
    reply = unpack(s.recv())
    s.close()
    ctx.term()
    return reply


def test_server_answers_bad_messages_and_keeps_serving(rpc_server):
    _, ep = rpc_server
    assert "not a msgpack" in _call(ep, b"\xc1garbage")["error"]
    assert "'cmd'" in _call(ep, pack([1, 2]))["error"]
    assert "unknown command 'nope'" in _call(ep, pack({"cmd": "nope"}))["error"]
    err = _call(ep, pack({"cmd": "add", "args": {"a": "x", "b": 2}}))["error"]
    assert "field 'a'" in err
    assert "missing" in _call(ep, pack({"cmd": "add", "args": {"a": 1}}))["error"].lower()
    assert "kaput" in _call(ep, pack({"cmd": "boom"}))["error"]
    assert _call(ep, pack({"cmd": "add", "args": {"a": 2, "b": 3}})) == {"ok": True, "sum": 5}


def test_client_reports_a_dead_process_instead_of_hanging(rpc_server):
    import asyncio
    import zmq.asyncio

    proc, ep = rpc_server

    async def go():
        ctx = zmq.asyncio.Context()
        c = RpcClient(ctx, "srv", ep, alive=lambda: proc.poll() is None)
        assert (await c.call("add", a=1, b=1))["sum"] == 2
        with pytest.raises(ControlError, match="kaput"):
            await c.call("boom")
        proc.kill()
        proc.wait()
        # noticed by the liveness check ("process exited"), not by the timeout ("no reply")
        with pytest.raises(ControlError, match="process exited"):
            await c.call("add", a=1, b=1, timeout_s=30)
        with pytest.raises(ControlError, match="srv"):
            await c.call("add", a=1, b=1)  # the client stays retired
        c.close()
        ctx.term()

    asyncio.run(go())
