"""Every KV connector on every path, without root: real model, real bytes, an in-memory transport.

The past KV of a prompt is put where the plan says the store reads land (the PE buffer, the DE
buffer or both); the prefill engine's real layer loop runs through the connector; the request's
area in the DE buffer must then hold exactly the KV a full recomputation gives, and the bytes
the PE sent must be what the path definitions say. A plan that put a block in the wrong buffer,
or a connector that forwarded the wrong rows, fails here.
"""
import numpy as np
import pytest
import torch

from dualpath.kv.buffers import ByteAllocator
from dualpath.kv.decode_connector import BufferDecodeConnector, DecodePlan
from dualpath.kv.check import crc as kv_crc
from dualpath.engines.prefill import prefill_batch
from dualpath.kv.connector import BasicConnector, LayerwiseConnector, LoadPlan, PastRead
from dualpath.kv.plan import Route, plan_request
from dualpath.kv.spans import Span
from dualpath.kv.layouts import BlockGeometry, build_full_block, pack_rows
from dualpath.model import Transformer
from dualpath.model.tiny import DEMO, make_tiny_checkpoint
from dualpath.store.keys import chain_keys
from tests.fake_transport import FakeAgent, FakeNet

BUF = 1 << 20
PROMPT = [4 + (i * 7) % 500 for i in range(100)]  # 6 full blocks of 16 and a tail
N_HIT_BLOCKS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Transformer:
    torch.set_num_threads(1)
    return Transformer.from_pretrained(make_tiny_checkpoint(tmp_path_factory.mktemp("ck"), seed=0, **DEMO))


@pytest.fixture(scope="module")
def geom(model) -> BlockGeometry:
    return BlockGeometry.from_config(model.config, block_size=16)


@pytest.fixture(scope="module")
def ref(model):
    """The recomputation: every layer's KV of the whole prompt, and its next token."""
    r = model.prefill(PROMPT, last_only=True)
    return r.new_kv, int(r.logits[-1].argmax())


def _blocks(geom, kv, first_block, n_blocks) -> np.ndarray:
    bs = geom.block_size
    return np.concatenate([build_full_block([(k[b * bs:(b + 1) * bs], v[b * bs:(b + 1) * bs]) for k, v in kv],
                                            geom).numpy().reshape(-1) for b in range(first_block, first_block + n_blocks)])


def _rows(geom, kv, layer, n) -> np.ndarray:
    rows = torch.empty((n, geom.bytes_per_token_per_layer), dtype=torch.uint8)
    pack_rows(kv[layer][0][:n], kv[layer][1][:n], geom, rows)
    return rows.numpy().reshape(-1)


def _area_layer(buf, geom, off, layer, n) -> np.ndarray:
    """Rows [0, n) of one layer from an area in Full-Block layout."""
    bs, bpt = geom.block_size, geom.bytes_per_token_per_layer
    out = []
    for t in range(n):
        b, r = divmod(t, bs)
        a = off + b * geom.full_block_bytes + layer * geom.layer_block_bytes + r * bpt
        out.append(buf[a:a + bpt])
    return np.concatenate(out)


def _setup(geom, ref, path, pe_blocks):
    """The plan, its areas in two host buffers with the store's reads already landed, an engine."""
    kv, _ = ref
    net = FakeNet()
    bufs = {n: net.region(n, "buf", BUF) for n in ("p0", "d0")}
    keys = chain_keys(PROMPT, 16, namespace=b"t")
    plan = plan_request("r", PROMPT, 20, keys, N_HIT_BLOCKS, Route("p0e0", "d0e0", path, pe_blocks), geom,
                        "layerwise", "p0", "d0")
    off = {a.name: 4096 * (i + 1) for i, a in enumerate(plan.areas)}  # distinct, nonzero offsets
    node = {a.name: a.node for a in plan.areas}
    for load in plan.loads:  # what the host agents' store reads put there
        start = off[load.area] + load.first_block * geom.full_block_bytes
        data = _blocks(geom, kv, load.first_block, len(load.keys))
        bufs[load.node][start:start + len(data)] = data
    reads = tuple(PastRead(Span(node[p.area], "buf", off[p.area]), p.first, p.n) for p in plan.past)
    lp = LoadPlan("r", plan.n_hit, plan.n_miss, reads, Span("d0", "buf", off["de"]), plan.forward_past, tag="/c0")
    agent = FakeAgent("p0e0", net, "hbm", BUF)
    return net, bufs, plan, lp, agent, off


@pytest.mark.parametrize("connector_cls", [LayerwiseConnector, BasicConnector])
@pytest.mark.parametrize("path, pe_blocks", [("pe", N_HIT_BLOCKS), ("de", 0), ("split", 1)])
def test_the_de_area_ends_with_the_recomputed_kv_on_every_path(model, geom, ref, connector_cls, path, pe_blocks):
    kv, first_token = ref
    net, bufs, plan, lp, agent, off = _setup(geom, ref, path, pe_blocks)
    conn = connector_cls(agent, agent.local, ByteAllocator(BUF, "hbm"), geom)
    (out,), timing = prefill_batch(model, [(PROMPT[plan.n_hit:], lp, conn)])
    assert out.first_token == first_token
    for layer in range(geom.n_layer):
        assert np.array_equal(_area_layer(bufs["d0"], geom, off["de"], layer, len(PROMPT)),
                              _rows(geom, kv, layer, len(PROMPT))), (path, layer)
    bpt = geom.bytes_per_token_per_layer * geom.n_layer
    written = sum(n for op, _, _, n in net.posted if op == "WRITE")
    read_from = {peer: sum(n for op, p, _, n in net.posted if op == "READ" and p == peer) for peer in ("p0", "d0")}
    # the PE writes the miss rows and forwards the past it read on its own side, nothing else
    assert written == (plan.n_miss + plan.forward_past) * bpt
    assert read_from == {"p0": pe_blocks * 16 * bpt, "d0": (N_HIT_BLOCKS - pe_blocks) * 16 * bpt}
    assert [m for _, m in agent.notifs] == [f"r/c0/L{layer}" for layer in range(geom.n_layer)]
    # layerwise keeps about one layer of hit KV in HBM; basic all of them
    one_layer = plan.n_hit * geom.bytes_per_token_per_layer  # the first pass's past: the hits
    assert conn.stats.peak_hit_bytes == (2 if connector_cls is LayerwiseConnector else geom.n_layer) * one_layer


def test_a_later_chunk_waits_out_a_write_that_landed_late(model, geom, ref):
    kv, first_token = ref
    net, bufs, plan, lp, agent, off = _setup(geom, ref, "de", 0)
    conn = LayerwiseConnector(agent, agent.local, ByteAllocator(BUF, "hbm"), geom)
    chunk = 16  # the first pass computes 16 of the 36 miss tokens
    first = LoadPlan("r", plan.n_hit, chunk, lp.reads, lp.dst, tag="/c0")
    net.late_writes = geom.n_layer  # every layer's WRITE is reported done before its bytes land
    net.landing = False  # ... and they are still in flight when the next chunk starts reading
    (_,), _ = prefill_batch(model, [(PROMPT[plan.n_hit:plan.n_hit + chunk], first, conn)])
    net.landing = True
    crcs = conn.stats.write_crcs
    n_past = plan.n_hit + chunk
    second = LoadPlan("r", n_past, len(PROMPT) - n_past, (PastRead(lp.dst, 0, n_past),), lp.dst,
                      past_crcs=tuple(crcs), tag="/c1")
    conn2 = LayerwiseConnector(agent, agent.local, ByteAllocator(BUF, "hbm"), geom)
    (out,), _ = prefill_batch(model, [(PROMPT[n_past:], second, conn2)])
    assert conn2.stats.reread_bytes > 0  # it read stale rows, saw the CRC and read again
    assert out.first_token == first_token
    for layer in range(geom.n_layer):
        assert np.array_equal(_area_layer(bufs["d0"], geom, off["de"], layer, len(PROMPT)),
                              _rows(geom, kv, layer, len(PROMPT)))


def test_a_past_that_never_matches_its_crc_is_an_error_not_silent(model, geom, ref):
    net, bufs, plan, lp, agent, off = _setup(geom, ref, "de", 0)
    bad = tuple(kv_crc(_rows(geom, ref[0], layer, plan.n_hit)) ^ 1 for layer in range(geom.n_layer))
    chunk = LoadPlan("r", plan.n_hit, plan.n_miss, lp.reads, lp.dst, past_crcs=bad, tag="/c1")
    conn = LayerwiseConnector(agent, agent.local, ByteAllocator(BUF, "hbm"), geom, timeout_s=0.05)
    with pytest.raises(TimeoutError, match="never landed intact"):
        prefill_batch(model, [(PROMPT[plan.n_hit:], chunk, conn)])


def _decode_setup(geom, ref, stale_layer=None):
    kv, _ = ref
    net = FakeNet()
    de = net.region("d0", "buf", BUF)
    n = len(PROMPT)
    de[4096:4096 + 7 * geom.full_block_bytes] = _blocks(geom, [(k, v) for k, v in
                                                              ((torch.cat([k, k[:12]]), torch.cat([v, v[:12]])) for k, v in kv)],
                                                        0, 7)  # 7 blocks spanned (tail padded)
    crcs = tuple(kv_crc(_rows(geom, kv, layer, n)) for layer in range(geom.n_layer))
    if stale_layer is not None:  # a layer whose WRITE from the PE has not landed yet
        a = 4096 + stale_layer * geom.layer_block_bytes
        good = de[a:a + 8].copy()
        de[a:a + 8] ^= 0xFF
        net._late.append([3, lambda: de.__setitem__(slice(a, a + 8), good)])
    agent = FakeAgent("d0e0", net, "hbm", BUF)
    plan = DecodePlan("r", n, 20, 6, Span("d0", "buf", 4096), Span("d0", "buf", 200_000), crcs)
    return net, de, agent, plan


@pytest.mark.parametrize("stale", [None, 2])
def test_the_decode_connector_loads_the_prompt_and_saves_full_blocks(geom, ref, stale):
    kv, _ = ref
    net, de, agent, plan = _decode_setup(geom, ref, stale)
    conn = BufferDecodeConnector(agent, agent.local, ByteAllocator(BUF, "hbm"), geom, timeout_s=5)
    conn.start_load(plan)
    got = None
    for _ in range(10_000):
        got = conn.poll_load()
        if got is not None:
            break
    assert got is not None
    for (k, v), (rk, rv) in zip(got, kv):
        assert torch.equal(k, rk) and torch.equal(v, rv)
    assert (conn.stats.reread_bytes > 0) == (stale is not None)
    conn.save_block(6, [(torch.cat([k, k[:12]]), torch.cat([v, v[:12]])) for k, v in got])
    assert conn.poll_save()
    block = _blocks(geom, [(torch.cat([k, k[:12]]), torch.cat([v, v[:12]])) for k, v in kv], 6, 1)
    assert np.array_equal(de[200_000:200_000 + geom.full_block_bytes], block)
    assert agent.notifs == [("d0", "r/wb6")] and conn.stats.block_crcs == [kv_crc(block)]
    conn.close()
