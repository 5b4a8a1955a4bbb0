"""Engines on a GPU (dualpath/model/device.py): the device is checked before anything uses it,
the registered memory feeds it, and the KV that crosses it is the KV the model computed.

Without a GPU only the checks and the CPU path run; the CUDA tests skip (they need a CUDA
build of torch and a GPU it sees)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dualpath.kv.buffers import ByteAllocator
from dualpath.kv.connector import LayerwiseConnector
from dualpath.kv.decode_connector import BufferDecodeConnector
from dualpath.engines.prefill import prefill_batch
from dualpath.model import DecodeCache, Transformer
from dualpath.model.device import DeviceError, host_buffer, resolve_device, to_device
from dualpath.model.tiny import DEMO, make_tiny_checkpoint
from tests import test_connectors as tc
from tests.conftest import dualpath, needs_root

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU that torch sees (a CUDA build)")


def test_the_cpu_is_a_device_and_its_kv_is_the_registered_memory_itself():
    dev = resolve_device("cpu")
    buf = host_buffer(4096, dev)
    assert dev.type == "cpu" and isinstance(buf, np.ndarray) and buf.nbytes == 4096 and not buf.any()
    k, v = torch.from_numpy(buf[:2048]).view(torch.float32), torch.from_numpy(buf[2048:]).view(torch.float32)
    k2, v2 = to_device((k, v), dev)
    assert k2 is k and v2 is v  # no copy: the model reads what NIXL wrote


@pytest.mark.parametrize("name", ["tpu", "CUDA", "", "cuda:0" * 20])
def test_an_unknown_device_is_one_line_with_its_fix(name):
    with pytest.raises(DeviceError) as e:
        resolve_device(name)
    msg = str(e.value)
    assert "\n" not in msg and "is not one of cpu, cuda" in msg and "fix:" in msg and len(msg) < 200


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_says_why_and_what_to_do():
    with pytest.raises(DeviceError) as e:
        resolve_device("cuda")
    msg = str(e.value)
    assert "sees no GPU" in msg and torch.__version__ in msg and "fix:" in msg and "\n" not in msg
    if torch.version.cuda is None:
        assert "CPU-only build" in msg


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ck"), seed=0, **DEMO)


@cuda
def test_the_registered_memory_of_a_gpu_engine_is_page_locked_and_kv_crosses_it_unchanged():
    dev = resolve_device("cuda")
    buf = host_buffer(1 << 16, dev)
    t = torch.from_numpy(buf)
    assert t.is_pinned() and not buf.any()
    t[:] = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    k, v = t[:1 << 15].view(torch.float32), t[1 << 15:].view(torch.float32)
    gk, gv = to_device((k, v), dev)
    assert gk.device.type == "cuda" and torch.equal(gk.cpu(), k) and torch.equal(gv.cpu(), v)


@cuda
def test_the_model_on_a_gpu_gives_the_cpus_logits_within_fp32_tolerance(ckpt):
    cpu = Transformer.from_pretrained(ckpt)
    gpu = Transformer.from_pretrained(ckpt, device=resolve_device("cuda"))
    a, b = cpu.prefill(tc.PROMPT).logits, gpu.prefill(tc.PROMPT).logits
    assert b.device.type == "cuda"
    assert (a - b.cpu()).abs().max().item() <= 1e-4


@cuda
@pytest.mark.parametrize("path, pe_blocks", [("pe", tc.N_HIT_BLOCKS), ("de", 0), ("split", 1)])
def test_a_gpu_prefill_ends_with_its_own_recomputed_kv_in_the_de_area(ckpt, path, pe_blocks):
    """The past goes H2D from the registered memory, the new KV D2H into it: the DE area must
    hold, bit for bit, what the same model on the same GPU computes from scratch."""
    model = Transformer.from_pretrained(ckpt, device=resolve_device("cuda"))
    geom = tc.BlockGeometry.from_config(model.config, block_size=16)
    r = model.prefill(tc.PROMPT, last_only=True)
    ref = ([(k.cpu(), v.cpu()) for k, v in r.new_kv], int(r.logits[-1].argmax()))
    net, bufs, plan, lp, agent, off = tc._setup(geom, ref, path, pe_blocks)
    conn = LayerwiseConnector(agent, agent.local, ByteAllocator(tc.BUF, "hbm"), geom, device=model.device)
    (out,), _ = prefill_batch(model, [(tc.PROMPT[plan.n_hit:], lp, conn)])
    assert out.first_token == ref[1]
    for layer in range(geom.n_layer):
        assert np.array_equal(tc._area_layer(bufs["d0"], geom, off["de"], layer, len(tc.PROMPT)),
                              tc._rows(geom, ref[0], layer, len(tc.PROMPT))), (path, layer)


@cuda
def test_a_gpu_decode_loads_the_prompt_into_gpu_memory_and_saves_blocks_from_it(ckpt):
    model = Transformer.from_pretrained(ckpt, device=resolve_device("cuda"))
    geom = tc.BlockGeometry.from_config(model.config, block_size=16)
    kv = [(k.cpu(), v.cpu()) for k, v in model.prefill(tc.PROMPT, last_only=True).new_kv]
    net, de, agent, plan = tc._decode_setup(geom, (kv, 0))
    conn = BufferDecodeConnector(agent, agent.local, ByteAllocator(tc.BUF, "hbm"), geom, timeout_s=5,
                                 device=model.device)
    conn.start_load(plan)
    got = next(g for g in (conn.poll_load() for _ in range(10_000)) if g is not None)
    assert all(k.device.type == "cuda" and torch.equal(k.cpu(), rk) and torch.equal(v.cpu(), rv)
               for (k, v), (rk, rv) in zip(got, kv))
    cache = DecodeCache(model, got)  # what the decode batch steps on
    assert model.decode_step([7], [cache])[0] == int(model.prefill(tc.PROMPT + [7], last_only=True).logits[-1].argmax())
    conn.save_block(6, [(torch.cat([k, k[:12]]), torch.cat([v, v[:12]])) for k, v in got])
    assert conn.poll_save()
    block = tc._blocks(geom, [(torch.cat([k, k[:12]]), torch.cat([v, v[:12]])) for k, v in kv], 6, 1)
    assert np.array_equal(de[200_000:200_000 + geom.full_block_bytes], block)


@cuda
@needs_root
def test_a_run_with_its_engines_on_the_gpu_is_bit_exact_against_a_gpu_recomputation(no_leftovers, tmp_path):
    r = dualpath("run", "topologies/1p1d.yaml", "--device", "cuda", "--trajectories", "2",
                 "--modes", "basic,layerwise,dualpath", "--out", str(tmp_path), timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (summary,) = tmp_path.glob("*/summary.json")
    s = json.loads(summary.read_text())
    assert s["device"] == "cuda"
    for mode, m in s["modes"].items():
        assert m["errors"] == 0 and m["verification"]["all_match"], (mode, m["verification"])
        assert m["kv_bytes_vs_expected"]["within"] == m["kv_bytes_vs_expected"]["nics"], mode
