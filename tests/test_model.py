"""The per-layer model against the transformers reference, and its KV-reuse determinism.

Tolerance against transformers: max |logit difference| <= 1e-4 in float32 (observed ~1e-5 with
logits of magnitude ~5). Our model and transformers do the same math in a different order (tiled
GEMMs, a per-tile softmax, RoPE tables built once), so float32 rounding differs in the last bits;
1e-4 is ~10 ulp at the logits' magnitude and far below any real mismatch (a wrong bias, head order
or RoPE shows up as O(0.1-1)).

Against itself the model is bit-exact: prefill with past KV, decode and full recomputation give
identical logits and KV (see the module docstring of dualpath/model/transformer.py).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from dualpath.model import CheckpointError, Transformer, bytes_per_token_per_layer, concat_kv, load_config
from dualpath.model.config import config_from_dict
from dualpath.model.tiny import make_tiny_checkpoint

LOGIT_ATOL = 1e-4
KV_ATOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # The CPU is shared: with several OpenMP threads on a busy 2-core box a tiny model spends its
    # time spin-waiting (measured 15x slower). One thread is also what the engines run with.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {kind: make_tiny_checkpoint(root / kind, seed=0, kind=kind) for kind in ("qwen2", "llama")}


@pytest.fixture(scope="module")
def models(ckpt):
    return {kind: Transformer.from_pretrained(p) for kind, p in ckpt.items()}


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def kv_equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


# -- against transformers ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_logits_and_kv_match_transformers(kind, ckpt, models):
    ref = reference(ckpt[kind])
    toks = tokens(300)
    with torch.no_grad():
        out = ref(toks[None], use_cache=True)
    mine = models[kind].prefill(toks)
    assert mine.logits.shape == (300, 512)
    diff = (mine.logits - out.logits[0]).abs().max().item()
    assert diff <= LOGIT_ATOL, f"max |logit diff| {diff}"
    assert out.logits.abs().max() > 1.0  # the comparison is not between near-zero numbers
    cache = out.past_key_values
    for l, (k, v) in enumerate(mine.new_kv):
        # transformers caches [batch, n_kv_heads, n_tokens, head_dim]; ours is [n_tokens, n_kv_heads, head_dim]
        hk, hv = cache.layers[l].keys[0].transpose(0, 1), cache.layers[l].values[0].transpose(0, 1)
        assert k.shape == hk.shape == (300, 2, 32)
        assert (k - hk).abs().max() <= KV_ATOL and (v - hv).abs().max() <= KV_ATOL


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_greedy_generate_matches_transformers(kind, ckpt, models):
    ref = reference(ckpt[kind])
    prompt = tokens(100, seed=2)
    with torch.no_grad():
        want = ref.generate(prompt[None], max_new_tokens=24, do_sample=False)[0, 100:].tolist()
    got = models[kind].generate(prompt, 24).tokens
    assert got == want
    assert len(set(got)) > 5  # the tiny model's output depends on context, so this comparison means something


def test_rope_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from dualpath.model.tiny import tiny_hf_config
    from dualpath.model.transformer import rope_inv_freq

    hf = tiny_hf_config("llama")
    ours = rope_inv_freq(config_from_dict(hf.to_dict()).rope, 32)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf)
    assert torch.equal(ours, theirs)
    plain = rope_inv_freq(config_from_dict({**hf.to_dict(), "rope_parameters": {"rope_theta": 500000.0}}).rope, 32)
    assert not torch.equal(ours, plain)  # the llama3 scaling is really exercised by the tiny llama


# -- KV reuse: bit-exact against full recomputation ---------------------------------------------

@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_prefill_with_past_is_bit_exact(kind, models):
    m = models[kind]
    toks = tokens(200, seed=3)
    full = m.prefill(toks)
    for split in (1, 15, 16, 17, 100, 199):  # inside, at and across tile boundaries
        first = m.prefill(toks[:split])
        rest = m.prefill(toks[split:], first.new_kv)
        assert rest.n_past == split
        assert torch.equal(torch.cat([first.logits, rest.logits]), full.logits), f"split {split}"
        assert kv_equal(concat_kv(first.new_kv, rest.new_kv), full.new_kv), f"split {split}"
    # three chunks, the last one token (a decode step)
    a, b = m.prefill(toks[:37]), None
    b = m.prefill(toks[37:199], a.new_kv)
    c = m.prefill(toks[199:], concat_kv(a.new_kv, b.new_kv), last_only=True)
    assert torch.equal(c.logits, full.logits[-1:])
    assert kv_equal(concat_kv(concat_kv(a.new_kv, b.new_kv), c.new_kv), full.new_kv)


def test_decode_kv_equals_recomputation(models):
    m = models["qwen2"]
    prompt = tokens(45, seed=4)
    gen = m.generate(prompt, 20)
    seq = torch.cat([prompt, torch.tensor(gen.tokens[:-1])])
    again = m.prefill(seq)
    assert kv_equal(gen.kv, again.new_kv)
    assert again.logits[44:].argmax(-1).tolist() == gen.tokens


def test_multi_turn_generate_with_past_equals_from_scratch(models):
    m = models["llama"]
    turn1 = m.generate(tokens(40, seed=5), 8)
    append = tokens(13, seed=6)
    # next turn: reuse the KV of turn 1, feed the last generated token plus the new user tokens
    cont = m.generate(torch.cat([torch.tensor(turn1.tokens[-1:]), append]), 8, past_kv=turn1.kv)
    scratch = m.generate(torch.cat([tokens(40, seed=5), torch.tensor(turn1.tokens), append]), 8)
    assert cont.tokens == scratch.tokens
    assert kv_equal(cont.kv, scratch.kv)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_a_batched_decode_step_is_bit_exact_with_decoding_each_alone(kind, models):
    from dualpath.model import DecodeCache

    m = models[kind]
    lens = (1, 15, 16, 17, 40, 129, 300, 2)  # inside, at and across tile boundaries
    pasts = [m.prefill(tokens(n, seed=20 + i)).new_kv for i, n in enumerate(lens)]
    caches = [DecodeCache(m, kv) for kv in pasts]
    toks = [int(t) for t in tokens(len(lens), seed=99)]
    for _ in range(20):  # twenty steps: contexts grow, tiles fill and the caches grow a tile
        alone = [m.prefill([t], past_kv=p, last_only=True) for t, p in zip(toks, pasts)]
        got = m.decode_step(toks, caches)
        assert got == [int(r.logits[-1].argmax()) for r in alone]
        pasts = [concat_kv(p, r.new_kv) for p, r in zip(pasts, alone)]
        for cache, p in zip(caches, pasts):
            assert cache.n == p[0][0].shape[0] and kv_equal(cache.kv(), p)
        toks = got
    assert m.decode_step([], []) == []


def test_a_decode_step_packs_tokens_that_share_a_row_into_separate_tiles(models):
    """Many sequences, several on each row of a tile (so tokens share tiles and some rows need a
    second and third tile), and a step's tokens bit-exact with each sequence decoded alone."""
    from dualpath.model import DecodeCache

    m = models["llama"]
    lens = (3, 19, 35, 8, 24, 5, 16, 0, 31, 47, 12)  # rows 3, 3, 3, 8, 8, 5, 0, 0, 15, 15, 12
    pasts = [m.prefill(tokens(n, seed=50 + i)).new_kv if n else [] for i, n in enumerate(lens)]
    caches = [DecodeCache(m, kv) for kv in pasts]
    toks = [int(t) for t in tokens(len(lens), seed=98)]
    for _ in range(18):
        alone = [m.prefill([t], past_kv=p or None, last_only=True) for t, p in zip(toks, pasts)]
        got = m.decode_step(toks, caches)
        assert got == [int(r.logits[-1].argmax()) for r in alone]
        pasts = [concat_kv(p or None, r.new_kv) for p, r in zip(pasts, alone)]
        assert all(kv_equal(c.kv(), p) for c, p in zip(caches, pasts))
        toks = got


def test_wrong_past_kv_changes_the_output(models):
    m = models["qwen2"]
    toks = tokens(64, seed=7)
    first = m.prefill(toks[:48])
    right = m.prefill(toks[48:], first.new_kv)
    bad = [(k.clone(), v.clone()) for k, v in first.new_kv]
    bad[2][1][5] += 0.5  # one token's V in one layer
    wrong = m.prefill(toks[48:], bad)
    assert (wrong.logits - right.logits).abs().max() > 1e-3


def test_layer_loop_equals_prefill(models):
    m = models["qwen2"]
    toks = tokens(40, seed=8)
    first = m.prefill(toks[:21])
    x = m.embed(toks[21:])
    for l in range(m.config.n_layer):
        x, k, v = m.layer_forward(l, x, torch.arange(21, 40), *first.new_kv[l])
        assert k.shape == v.shape == (19, 2, 32)
    assert torch.equal(m.logits(x, 21), m.prefill(toks[21:], first.new_kv).logits)


def test_layer_forward_rejects_bad_arguments(models):
    m = models["qwen2"]
    x = m.embed([1, 2, 3])
    past = m.prefill([4, 5]).new_kv[0]
    with pytest.raises(ValueError, match="start at position 2"):
        m.layer_forward(0, x, 0, *past)
    with pytest.raises(ValueError, match="contiguous"):
        m.layer_forward(0, x, [2, 3, 5], *past)
    with pytest.raises(ValueError, match="past_k must be"):
        m.layer_forward(0, x, 2, past[0][:, :1], past[1])
    with pytest.raises(ValueError, match="token ids"):
        m.embed([512])


# -- sizes and checkpoints ---------------------------------------------------------------------

def test_bytes_per_token_per_layer(ckpt, models):
    cfg = load_config(ckpt["qwen2"])
    assert (cfg.n_layer, cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (4, 128, 4, 2, 32)
    assert bytes_per_token_per_layer(cfg, torch.float32) == 2 * 2 * 32 * 4 == 512
    assert bytes_per_token_per_layer(cfg, "bfloat16") == 256
    assert bytes_per_token_per_layer(cfg) == 512  # the checkpoint's dtype
    assert models["qwen2"].bytes_per_token_per_layer == 512
    k, v = models["qwen2"].prefill([1, 2, 3]).new_kv[0]
    assert k.element_size() * k[0].numel() + v.element_size() * v[0].numel() == 512


def test_tiny_checkpoint_is_deterministic(tmp_path, ckpt):
    for kind in ("qwen2", "llama"):
        again = make_tiny_checkpoint(tmp_path / kind, seed=0, kind=kind)
        for f in ("config.json", "model.safetensors"):
            assert (again / f).read_bytes() == (ckpt[kind] / f).read_bytes(), f"{kind}/{f}"
    other = make_tiny_checkpoint(tmp_path / "seed1", seed=1)
    assert (other / "model.safetensors").read_bytes() != (ckpt["qwen2"] / "model.safetensors").read_bytes()


def test_script_writes_the_same_checkpoint(tmp_path, ckpt, capsys):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "make_tiny_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_tiny_checkpoint", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(tmp_path / "c"), "--kind", "llama"]) == 0
    assert (tmp_path / "c" / "model.safetensors").read_bytes() == (ckpt["llama"] / "model.safetensors").read_bytes()
    assert "512 B/token/layer" in capsys.readouterr().out


def test_sharded_checkpoint_loads_the_same(tmp_path, ckpt, models):
    from safetensors.torch import load_file, save_file

    src = ckpt["llama"]
    dst = tmp_path / "sharded"
    dst.mkdir()
    shutil.copy(src / "config.json", dst)
    state = load_file(str(src / "model.safetensors"))
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for fname, part in shards.items():
        save_file({n: state[n] for n in part}, str(dst / fname))
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    m = Transformer.from_pretrained(dst)
    toks = tokens(20, seed=9)
    assert torch.equal(m.prefill(toks).logits, models["llama"].prefill(toks).logits)


def test_old_style_config_is_read(ckpt):
    new = json.loads((ckpt["llama"] / "config.json").read_text())
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "dtype")}
    rp = new["rope_parameters"]
    old["rope_theta"] = rp["rope_theta"]
    old["rope_scaling"] = {"type": "llama3", **{k: v for k, v in rp.items() if k not in ("rope_theta", "rope_type")}}
    old["torch_dtype"] = "float32"
    assert config_from_dict(old) == config_from_dict(new)


def _checkpoint_copy(src, dst, **changes):
    shutil.copytree(src, dst)
    d = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    (dst / "config.json").write_text(json.dumps(d))
    return dst


@pytest.mark.parametrize("changes, field", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"model_type": None}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_parameters"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_size": None}, "hidden_size"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
])
def test_unsupported_config_is_one_clear_line(tmp_path, ckpt, changes, field):
    bad = _checkpoint_copy(ckpt["qwen2"], tmp_path / "bad", **changes)
    with pytest.raises(CheckpointError) as e:
        Transformer.from_pretrained(bad)
    msg = str(e.value)
    assert "\n" not in msg and str(bad / "config.json") in msg and f"'{field}'" in msg, msg


def test_bad_checkpoint_directories(tmp_path, ckpt):
    with pytest.raises(CheckpointError, match="does not exist"):
        Transformer.from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        Transformer.from_pretrained(tmp_path / "empty")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(ckpt["qwen2"] / "config.json", no_weights)
    with pytest.raises(CheckpointError, match="missing model.safetensors or model.safetensors.index.json"):
        Transformer.from_pretrained(no_weights)
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        Transformer.from_pretrained(tmp_path / "garbled")
    # weights that do not fit the config: the llama weights under a qwen2 config lack the q/k/v biases
    mixed = _checkpoint_copy(ckpt["qwen2"], tmp_path / "mixed")
    shutil.copy(ckpt["llama"] / "model.safetensors", mixed)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: (unexpected|missing) tensors"):
        Transformer.from_pretrained(mixed)
    # a shape that disagrees with config.json
    wide = _checkpoint_copy(ckpt["qwen2"], tmp_path / "wide", intermediate_size=512)
    with pytest.raises(CheckpointError, match="has shape .* config.json implies"):
        Transformer.from_pretrained(wide)
