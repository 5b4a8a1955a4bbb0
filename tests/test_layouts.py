"""Full Block / Layer Block layouts: zero-copy views, byte-for-byte concatenation, bit-exact packing."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.kv.layouts import (DEFAULT_BLOCK_SIZE, BlockGeometry, build_full_block, concat_layer_blocks,
                              empty_full_block, full_block_view, full_blocks_from_kv, kv_from_full_blocks,
                              layer_block, layer_blocks, pack_layer, split_full_block, unpack_layer)
from dualpath.model import load_config
from dualpath.model.config import config_from_dict

GEOM = BlockGeometry(n_layer=4, block_size=16, n_kv_heads=2, head_dim=32, dtype=torch.float32)
INT_OF = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def random_kv(n: int, geom: BlockGeometry, seed: int = 0):
    """K, V with arbitrary bit patterns (NaN payloads, -0.0, denormals included)."""
    g = torch.Generator().manual_seed(seed)
    it = INT_OF[geom.dtype]
    info = torch.iinfo(it)
    shape = (n, geom.n_kv_heads, geom.head_dim)
    return tuple(torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(it).view(geom.dtype)
                 for _ in range(2))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT_OF[t.dtype])


def test_geometry_from_model_config():
    d = {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "dtype": "float32"}
    cfg = config_from_dict(d)
    g = BlockGeometry.from_config(cfg)
    assert g == GEOM and DEFAULT_BLOCK_SIZE == 16
    assert g.bytes_per_token_per_layer == 2 * 2 * 32 * 4 == 512
    assert g.layer_block_bytes == 16 * 512 and g.full_block_bytes == 4 * 16 * 512
    assert g.full_block_shape == (4, 16, 512) and g.layer_block_shape == (16, 512)
    assert [g.layer_block_offset(l) for l in range(4)] == [0, 8192, 16384, 24576]
    assert g.n_blocks(47) == 2
    bf = BlockGeometry.from_config(cfg, dtype="bfloat16", block_size=64)
    assert bf.bytes_per_token_per_layer == 256 and bf.full_block_shape == (4, 64, 256)
    # a Llama-shaped config with an explicit head_dim
    big = config_from_dict({**d, "model_type": "llama", "hidden_size": 2048, "num_attention_heads": 32,
                            "num_key_value_heads": 8, "head_dim": 64, "num_hidden_layers": 16,
                            "dtype": "bfloat16"})
    assert BlockGeometry.from_config(big).bytes_per_token_per_layer == 2 * 8 * 64 * 2
    with pytest.raises(ValueError):
        BlockGeometry(0, 16, 2, 32, torch.float32)


def test_layer_blocks_are_zero_copy_views():
    full = empty_full_block(GEOM)
    for l in range(GEOM.n_layer):
        lb = layer_block(full, l)
        assert lb.shape == GEOM.layer_block_shape
        assert lb.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
        assert lb.data_ptr() == full.data_ptr() + GEOM.layer_block_offset(l)
        lb.fill_(l + 1)  # writes land in the Full Block
    for l in range(GEOM.n_layer):
        off = GEOM.layer_block_offset(l)
        assert bool((full.reshape(-1)[off:off + GEOM.layer_block_bytes] == l + 1).all())


@pytest.mark.parametrize("kind", ["bytearray", "numpy", "memoryview", "tensor"])
def test_full_block_view_shares_the_callers_buffer(kind):
    size = 100 + 2 * GEOM.full_block_bytes
    raw = {"bytearray": bytearray(size), "numpy": np.zeros(size, np.uint8),
           "memoryview": memoryview(bytearray(size)), "tensor": torch.zeros(size, dtype=torch.uint8)}[kind]
    off = 100 + GEOM.full_block_bytes  # the second block slot of a staging buffer
    full = full_block_view(raw, GEOM, offset=off)
    k, v = random_kv(GEOM.block_size, GEOM)
    pack_layer(k, v, GEOM, out=layer_block(full, 2))
    flat = np.frombuffer(raw, np.uint8) if kind != "tensor" else raw.numpy()
    start = off + GEOM.layer_block_offset(2)
    assert flat[start:start + GEOM.layer_block_bytes].tobytes() == pack_layer(k, v, GEOM).numpy().tobytes()
    assert not flat[:start].any() and not flat[start + GEOM.layer_block_bytes:].any()
    if kind == "numpy":
        assert np.shares_memory(full.numpy(), raw)
    with pytest.raises(ValueError, match="does not fit"):
        full_block_view(raw, GEOM, offset=size - 10)


def test_read_only_buffer_is_refused():
    with pytest.raises(ValueError, match="read-only"):
        full_block_view(bytes(GEOM.full_block_bytes), GEOM)


def test_layer_blocks_concatenate_to_the_full_block_byte_for_byte():
    kv = [random_kv(GEOM.block_size, GEOM, seed=l) for l in range(GEOM.n_layer)]
    full = build_full_block(kv, GEOM)
    lbs = layer_blocks(full)
    assert b"".join(lb.numpy().tobytes() for lb in lbs) == full.numpy().tobytes()
    assert torch.equal(concat_layer_blocks(lbs), full)
    # and the other way: Layer Blocks packed separately, laid end to end, are that Full Block
    separate = [pack_layer(k, v, GEOM) for k, v in kv]
    assert b"".join(t.numpy().tobytes() for t in separate) == full.numpy().tobytes()


def test_token_row_is_k_then_v():
    k, v = random_kv(3, GEOM)
    rows = pack_layer(k, v, GEOM)
    assert rows.shape == (3, GEOM.bytes_per_token_per_layer)
    for i in range(3):
        assert rows[i].numpy().tobytes() == k[i].numpy().tobytes() + v[i].numpy().tobytes()


@settings(max_examples=40, deadline=None)
@given(n_layer=st.integers(1, 4), block_size=st.integers(1, 20), n_kv=st.integers(1, 4),
       head_dim=st.sampled_from([2, 8, 64]), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_pack_unpack_round_trip_is_bit_exact(n_layer, block_size, n_kv, head_dim, dtype, seed):
    g = BlockGeometry(n_layer, block_size, n_kv, head_dim, dtype)
    kv = [random_kv(block_size, g, seed=seed + l) for l in range(n_layer)]
    full = build_full_block(kv, g)
    assert full.shape == g.full_block_shape and full.numel() == g.full_block_bytes
    for (k, v), (k2, v2) in zip(kv, split_full_block(full, g)):
        assert k2.dtype == dtype and k2.shape == k.shape
        assert torch.equal(bits(k2), bits(k)) and torch.equal(bits(v2), bits(v))
    # a partial layer (the tail of a turn) round-trips too
    n = max(1, block_size // 2)
    k, v = kv[0][0][:n], kv[0][1][:n]
    k2, v2 = unpack_layer(pack_layer(k, v, g), g)
    assert torch.equal(bits(k2), bits(k)) and torch.equal(bits(v2), bits(v))


def test_unpack_is_a_view_of_the_block():
    full = build_full_block([random_kv(16, GEOM, seed=l) for l in range(4)], GEOM)
    k, v = unpack_layer(layer_block(full, 1), GEOM)
    k[0, 0, 0] = 1.5
    assert unpack_layer(layer_block(full, 1), GEOM)[0][0, 0, 0] == 1.5
    assert v.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()


def test_pack_in_place_touches_only_its_rows():
    full = empty_full_block(GEOM)
    k, v = random_kv(5, GEOM)
    pack_layer(k, v, GEOM, out=layer_block(full, 3))
    assert not full[:3].any() and not full[3, 5:].any() and full[3, :5].any()


def test_bad_inputs_are_refused():
    k, v = random_kv(17, GEOM)
    with pytest.raises(ValueError, match="do not fit a block"):
        pack_layer(k, v, GEOM)
    with pytest.raises(ValueError, match="dtype"):
        pack_layer(k[:4].to(torch.float16), v[:4].to(torch.float16), GEOM)
    with pytest.raises(ValueError, match="must be"):
        pack_layer(k[:4, :1], v[:4, :1], GEOM)
    with pytest.raises(ValueError, match="needs 16 tokens"):
        build_full_block([(k[:4], v[:4])] * 4, GEOM)
    with pytest.raises(IndexError):
        layer_block(empty_full_block(GEOM), 4)


def test_model_kv_through_full_blocks_reproduces_the_logits(tmp_path):
    """A prompt's KV stored as Full Blocks and read back as Layer Blocks drives a bit-exact prefill."""
    from dualpath.model import Transformer
    from dualpath.model.tiny import make_tiny_checkpoint

    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = make_tiny_checkpoint(tmp_path / "tiny")
        m = Transformer.from_pretrained(path)
        geom = BlockGeometry.from_config(load_config(path), dtype=m.dtype)
        toks = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(0))
        full = m.prefill(toks)
        blocks = full_blocks_from_kv(full.new_kv, geom)  # 4 complete blocks = 64 hit tokens
        assert len(blocks) == 4 and all(b.shape == geom.full_block_shape for b in blocks)
        # a staging buffer holding the blocks back to back, as a host agent would
        buf = np.zeros(len(blocks) * geom.full_block_bytes, np.uint8)
        for i, b in enumerate(blocks):
            full_block_view(buf, geom, offset=i * geom.full_block_bytes).copy_(b)
        staged = [full_block_view(buf, geom, offset=i * geom.full_block_bytes) for i in range(len(blocks))]
        hit = kv_from_full_blocks(staged, geom)
        assert all(torch.equal(k, fk[:64]) and torch.equal(v, fv[:64]) for (k, v), (fk, fv) in zip(hit, full.new_kv))
        # the engine's layer loop, fed one Layer Block at a time per layer
        x = m.embed(toks[64:])
        for l in range(geom.n_layer):
            parts = [unpack_layer(layer_block(b, l), geom) for b in staged]
            pk, pv = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            x, _, _ = m.layer_forward(l, x, 64, pk, pv)
        assert torch.equal(m.logits(x, 64), full.logits[64:])
    finally:
        torch.set_num_threads(n_threads)
