"""The tiled layer against a plain statement of its semantics, bit for bit.

`reference_layer_forward` below is the tile semantics of dualpath/model/transformer.py written
the obvious way (a zero-padded token-major K/V buffer of every position, copied per tile into
the head-major layout attention multiplies). The model's own layer_forward builds its buffers
differently to save copies; it must still hand every op the same values in the same shapes, so
its outputs must equal the reference's exactly, for any past length and chunk, including
partial tiles at both ends. A second test fills fresh allocations with NaN, so an optimisation
that leaves padding unwritten (or writes the wrong range) cannot pass by luck of zeroed pages.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dualpath.model import Transformer
from dualpath.model.tiny import make_tiny_checkpoint
from dualpath.model.transformer import _rotate_half


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {kind: Transformer.from_pretrained(make_tiny_checkpoint(root / kind, seed=0, kind=kind))
            for kind in ("qwen2", "llama")}


def reference_layer_forward(m: Transformer, l: int, hidden: torch.Tensor, P: int, past_k, past_v):
    c, T, w = m.config, m.tile, m.layers[l]
    n = hidden.shape[0]
    kv_shape = (c.n_kv_heads, c.head_dim)
    t0, t1 = P // T, -(-(P + n) // T)
    m._ensure_rope(t1 * T)
    K = torch.zeros(t1 * T, *kv_shape, dtype=m.dtype)
    V = torch.zeros_like(K)
    if P:
        K[:P], V[:P] = past_k, past_v
    off = P - t0 * T
    x = hidden.new_zeros(((t1 - t0) * T, c.hidden_size))
    x[off:off + n] = hidden
    out = torch.empty_like(x)
    for t in range(t0, t1):
        rows = slice((t - t0) * T, (t - t0 + 1) * T)
        lo, hi = max(P, t * T), min(P + n, (t + 1) * T)
        xt = x[rows]
        h = m._rmsnorm(xt, w["ln1"])
        q = F.linear(h, w["wq"], w["bq"]).view(T, c.n_heads, c.head_dim)
        k = F.linear(h, w["wk"], w["bk"]).view(T, *kv_shape)
        v = F.linear(h, w["wv"], w["bv"]).view(T, *kv_shape)
        cos, sin = m._cos[t * T:(t + 1) * T, None, :], m._sin[t * T:(t + 1) * T, None, :]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        K[lo:hi], V[lo:hi] = k[lo - t * T:hi - t * T], v[lo - t * T:hi - t * T]
        L, g = (t + 1) * T, c.n_rep
        qh = q.view(T, c.n_kv_heads, g, c.head_dim).permute(1, 2, 0, 3).reshape(c.n_kv_heads, g * T, c.head_dim)
        kh = K[:L].permute(1, 2, 0).contiguous()
        vh = V[:L].permute(1, 0, 2).contiguous()
        s = (torch.bmm(qh, kh) * m.scale).view(c.n_kv_heads, g, T, L)
        s[..., L - T:].masked_fill_(m._tile_mask, float("-inf"))
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype).view(c.n_kv_heads, g * T, L)
        a = torch.bmm(p, vh).view(c.n_kv_heads, g, T, c.head_dim).permute(2, 0, 1, 3).reshape(T, -1)
        xt = xt + F.linear(a, w["wo"], w["bo"])
        h = m._rmsnorm(xt, w["ln2"])
        gate = F.silu(F.linear(h, w["wg"], w["bg"])) * F.linear(h, w["wu"], w["bu"])
        out[rows] = xt + F.linear(gate, w["wd"], w["bd"])
    return out[off:off + n], K[P:P + n].clone(), V[P:P + n].clone()


CASES = [(0, 1), (0, 16), (0, 37), (5, 1), (15, 1), (16, 1), (17, 30), (31, 2), (40, 24), (64, 65), (100, 1)]


def _inputs(m: Transformer, P: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    c = m.config
    past = (torch.randn(P, c.n_kv_heads, c.head_dim, generator=g), torch.randn(P, c.n_kv_heads, c.head_dim, generator=g))
    return torch.randn(n, c.hidden_size, generator=g), past if P else (None, None)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("P, n", CASES)
def test_layer_forward_equals_the_plain_tile_semantics(models, kind, P, n):
    m = models[kind]
    x, (pk, pv) = _inputs(m, P, n, seed=P * 1000 + n)
    for l in (0, m.config.n_layer - 1):
        got = m.layer_forward(l, x, P, pk, pv)
        want = reference_layer_forward(m, l, x, P, pk, pv)
        for name, a, b in zip(("hidden", "k_new", "v_new"), got, want):
            assert a.shape == b.shape and torch.equal(a, b), f"layer {l} P={P} n={n}: {name} differs"


def test_unwritten_buffers_cannot_leak_into_the_result(models, monkeypatch):
    m = models["qwen2"]
    cases = [(_inputs(m, P, n, seed=7 + P), P) for P, n in ((0, 5), (17, 1), (40, 24))]
    want = [reference_layer_forward(m, 1, x, P, pk, pv) for (x, (pk, pv)), P in cases]
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def nan_empty(*a, **kw):
        t = real_empty(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def nan_empty_like(*a, **kw):
        t = real_empty_like(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    monkeypatch.setattr(torch, "empty_like", nan_empty_like)
    for ((x, (pk, pv)), P), w in zip(cases, want):
        got = m.layer_forward(1, x, P, pk, pv)
        assert all(torch.equal(a, b) for a, b in zip(got, w)), f"P={P}"
