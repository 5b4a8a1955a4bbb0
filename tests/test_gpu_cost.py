"""The emulated GPU: coefficient classes, target model counts, target coefficients, Table 1."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from dualpath.scheduler.batching import PrefillItem, largest_fitting_chunk, pack_batch
from dualpath.scheduler.cost_model import (AttentionCostModel, DecodeCostModel, ProfileSample, attention_pairs,
                                           capped_pairs)
from emulators.gpu import GPUS, MODELS, GpuSpec, Target, TargetModel, dilation, gpu, model, table1_rows, target
from emulators.gpu.cost import TARGETS

# ---------------------------------------------------------------------------------------------
# dualpath.scheduler.cost_model: the capped term and the decode model
# ---------------------------------------------------------------------------------------------


def brute_capped(cached: int, new: int, cap: int) -> int:
    return sum(min(cached + i, cap) for i in range(1, new + 1))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 5000), st.integers(-3, 600), st.integers(0, 6000))
def test_capped_pairs_matches_brute_force(cached, new, cap):
    assert capped_pairs(cached, new, cap) == brute_capped(cached, new, cap)


def test_capped_pairs_edges():
    assert capped_pairs(0, 5, 3) == 1 + 2 + 3 + 3 + 3
    assert capped_pairs(10, 4, 3) == 12  # every query already past the cap
    assert capped_pairs(100, 50, 10**9) == attention_pairs(100, 50)  # a cap never reached is no cap
    assert capped_pairs(7, 9, 0) == 0  # cap 0: no capped attention
    with pytest.raises(ValueError):
        capped_pairs(1, 1, -1)


def test_request_cost_adds_the_capped_term():
    m = AttentionCostModel(intercept=1.0, per_new=2.0, per_pair=3.0, per_cached=5.0, per_capped_pair=7.0, pair_cap=4)
    # cached 2, new 3: pairs 3+4+5 = 12; capped min(3,4)+min(4,4)+min(5,4) = 11
    assert m.request_cost(2, 3) == 2 * 3 + 3 * 12 + 7 * 11 + 5 * 2
    assert m.request_cost(2, 0) == 0.0
    assert m.predict([(2, 3), (0, 1)]) == 1.0 + 129 + (2 + 3 + 7)


capped_models = st.builds(AttentionCostModel, intercept=st.floats(0, 0.05), per_new=st.floats(0, 1e-3),
                          per_pair=st.floats(0, 1e-8), per_cached=st.floats(0, 1e-6),
                          per_capped_pair=st.floats(1e-12, 1e-7), pair_cap=st.integers(1, 4096))


@settings(max_examples=300, deadline=None)
@given(capped_models, st.integers(0, 100_000), st.integers(0, 5000))
def test_request_cost_is_monotone_in_new(m, cached, new):
    assert m.request_cost(cached, new + 1) >= m.request_cost(cached, new)


@settings(max_examples=150, deadline=None)
@given(capped_models, st.integers(0, 20_000), st.integers(0, 300), st.floats(0, 0.3), st.floats(0.01, 0.5))
def test_chunk_search_holds_with_a_capped_model(m, cached, new, used, quota):
    k = largest_fitting_chunk(m, cached, new, used, quota)
    fits = [j for j in range(new + 1) if used + m.request_cost(cached, j) <= quota]
    assert k == (max(fits) if fits else 0)


def test_attention_cost_model_dicts_old_and_new():
    old = {"intercept": 0.1, "per_new": 1e-4, "per_pair": 1e-9, "per_cached": 1e-7}  # before the capped term
    m = AttentionCostModel.from_dict(old)
    assert (m.per_capped_pair, m.pair_cap) == (0.0, 0)
    c = AttentionCostModel(per_new=1.0, per_capped_pair=2.0, pair_cap=2048)
    assert AttentionCostModel.from_dict(c.to_dict()) == c
    assert AttentionCostModel.from_dict({**c.to_dict(), "pair_cap": 2048.0}).pair_cap == 2048  # JSON float
    with pytest.raises(ValueError):
        AttentionCostModel.from_dict({**c.to_dict(), "pair_cap": 2048.5})


@pytest.mark.parametrize("kw", [
    {"per_capped_pair": -1.0, "pair_cap": 4},
    {"per_capped_pair": float("inf"), "pair_cap": 4},
    {"per_capped_pair": 1.0, "pair_cap": 0},  # a capped coefficient that could never apply
    {"pair_cap": -1},
    {"pair_cap": 2.0},
    {"pair_cap": True},
    {"per_new": float("nan")},
])
def test_attention_cost_model_validation(kw):
    with pytest.raises(ValueError):
        AttentionCostModel(**kw)


def test_fit_leaves_the_capped_term_at_zero():
    truth = AttentionCostModel(intercept=0.01, per_new=1e-5, per_pair=1e-9)
    samples = [ProfileSample(((c, n),), truth.predict([(c, n)])) for c in (0, 1000, 5000) for n in (1, 100, 700)]
    m = AttentionCostModel.fit(samples)
    assert (m.per_capped_pair, m.pair_cap) == (0.0, 0)
    assert len(AttentionCostModel.features([(1, 1)])) == 4


def test_decode_step_cost_arithmetic():
    d = DecodeCostModel(intercept=10.0, per_request=1.0, per_context=0.5, per_capped_context=2.0, context_cap=100)
    # contexts 40 and 300: 10 + (1 + 20 + 80) + (1 + 150 + 200)
    assert d.step_cost([40, 300]) == 10 + 101 + 351
    assert d.step_cost([]) == 0.0  # no sequences, no step
    dense = DecodeCostModel(intercept=1.0, per_request=2.0, per_context=3.0)
    assert dense.step_cost((5,)) == 1 + 2 + 15
    with pytest.raises(ValueError):
        d.step_cost([-1])


def test_decode_cost_model_dicts_and_validation():
    d = DecodeCostModel(intercept=1.0, per_request=2.0, per_context=3.0, per_capped_context=4.0, context_cap=2048)
    assert DecodeCostModel.from_dict(d.to_dict()) == d
    assert DecodeCostModel.from_dict({"intercept": 1.0, "per_request": 0.0, "per_context": 0.0}).context_cap == 0
    for kw in ({"intercept": -1.0}, {"per_capped_context": 1.0}, {"context_cap": -5}, {"context_cap": 1.5},
               {"per_context": float("inf")}):
        with pytest.raises(ValueError):
            DecodeCostModel(**kw)


# ---------------------------------------------------------------------------------------------
# emulators.gpu.models: counts from the public configs
# ---------------------------------------------------------------------------------------------

def test_published_parameter_counts():
    v3, q = MODELS["deepseek-v3"], MODELS["qwen2.5-32b"]
    assert v3.total_params == pytest.approx(671e9, rel=0.02)
    assert v3.active_params == pytest.approx(37e9, rel=0.03)
    assert q.total_params == pytest.approx(32.76e9, rel=0.01)
    assert q.active_params == q.total_params  # dense
    v32 = MODELS["deepseek-v3.2"]
    # DSA adds the indexer to every layer: wq_b, wk, k_norm (weight+bias), weights_proj
    assert v32.total_params - v3.total_params == 61 * (1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64)
    assert MODELS["ds-27b"].total_params == pytest.approx(27e9, rel=0.03)
    assert MODELS["ds-27b"].assumptions
    assert MODELS["deepseek-v3"].n_layers == 61 and q.n_layers == 64 and MODELS["ds-27b"].n_layers == 30


def test_kv_bytes_per_token():
    # FlashMLA FP8: 512 FP8 latent + 4 FP32 scales + 64 BF16 RoPE = 656 B per layer
    assert MODELS["deepseek-v3"].kv_bytes_per_token_per_layer == 656
    assert MODELS["deepseek-v3"].kv_bytes_per_token == 40_016
    assert MODELS["deepseek-v3.2"].kv_bytes_per_token == 40_016  # indexer keys not counted here
    assert MODELS["deepseek-v3.2"].indexer_key_bytes_per_token == 61 * 132
    assert MODELS["deepseek-v3"].indexer_key_bytes_per_token == 0
    assert MODELS["qwen2.5-32b"].kv_bytes_per_token == 262_144  # 2 * 8 * 128 * 2 B * 64 layers
    assert MODELS["ds-27b"].kv_bytes_per_token == 30 * 656


def test_flop_counts():
    v3, v32, q = MODELS["deepseek-v3"], MODELS["deepseek-v3.2"], MODELS["qwen2.5-32b"]
    assert q.attention_flops_per_pair == 64 * 4 * 40 * 128
    assert v3.attention_flops_per_pair == 61 * (2 * 128 * 576 + 2 * 128 * 512)
    assert v32.indexer_flops_per_pair == 61 * 2 * 64 * 128 and v3.indexer_flops_per_pair == 0
    assert v32.attention_key_cap == 2048 and v3.attention_key_cap == 0
    assert q.linear_flops_per_token == 2 * (q.total_params - 152064 * 5120)
    # the article's V3.2 numbers: about 74 GFLOPs linear, 35 GFLOPs main attention, 33 GFLOPs indexer at 32.7K
    assert v32.linear_flops_per_token == pytest.approx(74e9, rel=0.03)
    assert 2048 * v32.attention_flops_per_pair == pytest.approx(35e9, rel=0.02)
    assert 32721 * v32.indexer_flops_per_pair == pytest.approx(33e9, rel=0.02)
    # DSA: main attention stops growing at top-k, the indexer keeps growing
    assert v32.flops_per_new_token(10_000) - v32.flops_per_new_token(5_000) == 5_000 * v32.indexer_flops_per_pair
    assert v32.flops_per_new_token(1000) == v32.linear_flops_per_token + 1000 * (
        v32.attention_flops_per_pair + v32.indexer_flops_per_pair)


def test_weight_bytes_per_gpu():
    v3, q = MODELS["deepseek-v3"], MODELS["qwen2.5-32b"]
    assert q.weight_bytes() == 2 * q.total_params  # BF16, one full copy per GPU (DP)
    routed = 58 * 256 * 3 * 7168 * 2048
    assert v3.routed_expert_params == routed
    assert v3.ep == 16 and v3.weight_bytes() == (v3.total_params - routed + routed / 16) * 1.0
    assert v3.weight_bytes(ep=1) == v3.total_params
    for m in MODELS.values():  # every default fits its GPU's HBM with room for KV
        assert m.weight_bytes() < 0.85 * GPUS["h800"].hbm_bytes, m.name


# ---------------------------------------------------------------------------------------------
# Table 1
# ---------------------------------------------------------------------------------------------


def rows_by_key():
    return {(r["model"], r["context_tokens"]): r for r in table1_rows()}


@pytest.mark.parametrize("name,ctx", [(m, c) for m in ("deepseek-v3.2", "qwen2.5-32b") for c in (16384, 65536)])
def test_table1_within_ten_percent_of_the_paper(name, ctx):
    r = rows_by_key()[(name, ctx)]
    assert r["paper"] is not None and r["append_tokens"] == 429
    assert r["gb_per_pflop"] == pytest.approx(r["paper"], rel=0.10)


def test_table1_deepseek_v3_by_hand():
    """V3 by hand from its config numbers; recorded against the paper, not tuned to it."""
    h, L = 7168, 61
    attn = h * 1536 + 1536 + 1536 * 128 * 192 + h * 576 + 512 + 512 * 128 * 256 + 128 * 128 * h
    active = (L * (attn + 2 * h) + 3 * 3 * h * 18432 + 58 * (h * 256 + 256 + (8 + 1) * 3 * h * 2048)
              + 2 * 129280 * h + h)
    linear = 2 * (active - 129280 * h)
    pair = L * (2 * 128 * 576 + 2 * 128 * 512)
    kv = L * 656
    rows = rows_by_key()
    for ctx in (16384, 32768, 65536):
        by_hand = ctx * kv / (429 * (linear + ctx * pair)) * 1e6
        r = rows[("deepseek-v3", ctx)]
        assert r["gb_per_pflop"] == pytest.approx(by_hand, rel=1e-12)
        if r["paper"] is not None:
            print(f"deepseek-v3 @ {ctx}: {r['gb_per_pflop']:.2f} GB/PFLOP vs paper {r['paper']} "
                  f"({(r['gb_per_pflop'] / r['paper'] - 1) * 100:+.1f} %)")
    # dense attention: the ratio tends to a constant (kv / (429 * pair)), from below
    assert rows[("deepseek-v3", 65536)]["gb_per_pflop"] < kv / (429 * pair) * 1e6


def test_table1_shape():
    rows = table1_rows()
    assert {r["model"] for r in rows} == {"deepseek-v3", "deepseek-v3.2", "qwen2.5-32b", "ds-27b"}
    assert all(r["paper"] is None for r in rows if r["model"] == "ds-27b" or r["context_tokens"] == 32768)
    assert len(table1_rows(contexts=(1000,), append=100)) == 4
    # the ratio is a property of the model: GPU speed cancels
    t1, t2 = target("h800", "qwen2.5-32b"), target("h200", "qwen2.5-32b")
    assert t1.cache_compute_ratio(20_000) == t2.cache_compute_ratio(20_000)


# ---------------------------------------------------------------------------------------------
# emulators.gpu.cost: coefficients of small made-up models, by hand
# ---------------------------------------------------------------------------------------------

TOY_GPU = GpuSpec("toy", bf16_flops=1e9, hbm_bytes_per_s=1e6, hbm_bytes=1e9, efficiency=0.5)  # 5e8 FLOP/s, 5e5 B/s
F, B = 5e8, 5e5

TOY_DENSE = TargetModel("toy-gqa", "made up", {
    "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "intermediate_size": 128, "vocab_size": 100, "tie_word_embeddings": False,
}, weight_bytes_per_param=2, ep=1)
# per layer: q 64*64 + k,v 2*64*32 + o 64*64 = 12288, norms 128, mlp 3*64*128 = 24576 -> 36992
# total 2*36992 + embed 6400 + lm_head 6400 + final norm 64 = 86848; linear = 2*(86848 - 6400)
# KV: 2*2*16*2 = 128 B/layer -> 256 B; attention pair: 4*4*16 = 256/layer -> 512

TOY_DSA = TargetModel("toy-dsa", "made up", {
    "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
    "q_lora_rank": 32, "kv_lora_rank": 128, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "topk_method": "noaux_tc", "vocab_size": 100,
    "index_n_heads": 2, "index_head_dim": 16, "index_topk": 8,
}, weight_bytes_per_param=1, ep=4)
# attention/layer: q_a 2048 + 32 + q_b 32*2*24=1536 + kv_a 64*136=8704 + 128 + kv_b 128*2*32=8192 + o 2048
#   = 22688; indexer wq_b 1024 + wk 1024 + k_norm 32 + weights_proj 128 = 2208; + norms 128 -> 25024
# dense MLP (layer 0) 24576; MoE (layer 1) router 260 + (4 + 1) experts * 6144 = 30980
# total 2*25024 + 24576 + 30980 + 6400 + 6400 + 64 = 118468; active uses 2+1 experts: 106180
# routed 4*6144 = 24576 -> on one GPU (ep 4): 118468 - 24576 + 6144 = 100036 B; streamed - 6400 = 93636
# KV 128 + 4 + 16 = 148 B/layer -> 296; indexer key 16 + 4 = 20 -> 40
# main pair 2*2*136 + 2*2*128 = 1056/layer -> 2112; indexer pair 2*2*16 = 64/layer -> 128


def test_toy_counts():
    assert TOY_DENSE.total_params == 86848 and TOY_DENSE.linear_flops_per_token == 160896
    assert TOY_DENSE.kv_bytes_per_token == 256 and TOY_DENSE.attention_flops_per_pair == 512
    assert TOY_DSA.total_params == 118468 and TOY_DSA.active_params == 106180
    assert TOY_DSA.weight_bytes() == 100036 and TOY_DSA.streamed_weight_bytes() == 93636
    assert TOY_DSA.kv_bytes_per_token == 296 and TOY_DSA.indexer_key_bytes_per_token == 40
    assert TOY_DSA.attention_flops_per_pair == 2112 and TOY_DSA.indexer_flops_per_pair == 128


def approx_model(got, want: dict):
    for k, v in want.items():
        assert getattr(got, k) == pytest.approx(v, rel=1e-12, abs=0), k


def test_dense_prefill_and_decode_coefficients_by_hand():
    t = Target(TOY_GPU, TOY_DENSE)
    approx_model(t.prefill_cost(), {
        "intercept": 160896 / B, "per_new": 160896 / F + 256 / B, "per_pair": 512 / F,
        "per_cached": 256 / B, "per_capped_pair": 0.0, "pair_cap": 0})
    approx_model(t.decode_cost(), {
        "intercept": 160896 / B, "per_request": 160896 / F + 256 / B, "per_context": 512 / F + 256 / B,
        "per_capped_context": 0.0, "context_cap": 0})


def test_dsa_prefill_and_decode_coefficients_by_hand():
    t = Target(TOY_GPU, TOY_DSA)
    approx_model(t.prefill_cost(), {
        "intercept": 93636 / B, "per_new": 199560 / F + 336 / B, "per_pair": 128 / F,
        "per_capped_pair": 2112 / F, "pair_cap": 8, "per_cached": 336 / B})
    approx_model(t.decode_cost(), {
        "intercept": 93636 / B, "per_request": 199560 / F + 336 / B, "per_context": 128 / F + 40 / B,
        "per_capped_context": 2112 / F + 296 / B, "context_cap": 8})


def test_prefill_cost_agrees_with_flops_per_new_token():
    """A new token after `context` keys costs its FLOPs (prefill_cost minus the byte terms)."""
    for name in ("deepseek-v3.2", "qwen2.5-32b"):
        t = target("h800", name)
        m = t.prefill_cost()
        ctx = 40_000
        flops_s = (m.per_new * 1 + m.per_pair * attention_pairs(ctx - 1, 1) + m.per_capped_pair
                   * capped_pairs(ctx - 1, 1, m.pair_cap)) - (t.model.kv_bytes_per_token
                                                               + t.model.indexer_key_bytes_per_token) / t.gpu.achieved_bytes_per_s
        assert flops_s == pytest.approx(t.flops_per_new_token(ctx) / t.gpu.achieved_flops, rel=1e-9)


def test_prefill_tokens_per_s_fills_the_quota_by_brute_force():
    t = Target(TOY_GPU, TOY_DENSE)
    m = t.prefill_cost()
    quota, ctx, app = 1.0, 10, 5
    used, tokens = m.intercept, 0
    while True:  # whole requests, then the largest chunk of the next, one token at a time
        k = 0
        while k < app and used + m.request_cost(ctx, k + 1) <= quota:
            k += 1
        used += m.request_cost(ctx, k)
        tokens += k
        if k < app:
            break
    assert t.prefill_tokens_per_s(ctx, app, quota) == pytest.approx(tokens / used, rel=1e-12)
    # longer contexts prefill fewer new tokens per second
    big = target("h800", "qwen2.5-32b")
    rates = [big.prefill_tokens_per_s(c) for c in (0, 16384, 65536)]
    assert rates == sorted(rates, reverse=True)
    b = pack_batch([PrefillItem("x", 16384, 429)] * 100, big.prefill_cost())
    assert b.predicted_s <= 0.3


def test_dilation_arithmetic():
    assert dilation(1000, 250, 1.0) == 4.0
    assert dilation(1000, 250, 0.5) == 8.0  # testbed links at half the target's rate: loads last twice as long
    assert dilation(40_016, 40_016, 2.0) == 0.5
    for bad in ((0, 1, 1.0), (1, 0, 1.0), (1, 1, 0.0), (1, 1, -1.0)):
        with pytest.raises(ValueError):
            dilation(*bad)


def test_bad_names_are_one_line_errors():
    for call, bad in ((lambda: target("a100", "qwen2.5-32b"), "a100"), (lambda: target("h800", "llama"), "llama"),
                      (lambda: gpu("b200"), "b200"), (lambda: model("gpt"), "gpt")):
        with pytest.raises(KeyError) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and repr(bad) in msg and "valid:" in msg
    assert "h800" in str(pytest.raises(KeyError, target, "x", "qwen2.5-32b").value)
    assert "deepseek-v3.2" in str(pytest.raises(KeyError, target, "h800", "x").value)
    assert target("h800", "deepseek-v3.2") is TARGETS[("h800", "deepseek-v3.2")]


def test_spec_and_model_validation():
    with pytest.raises(ValueError):
        GpuSpec("x", 1e12, 1e12, 1e9, efficiency=0.0)
    with pytest.raises(ValueError):
        GpuSpec("x", -1.0, 1e12, 1e9)
    with pytest.raises(ValueError):
        TargetModel("x", "", MODELS["deepseek-v3"].config, weight_bytes_per_param=1, ep=512)  # > 256 experts
    assert GPUS["h800"].achieved_flops == pytest.approx(0.6 * 989.4e12)
    assert GPUS["h200"].achieved_bytes_per_s == pytest.approx(0.6 * 4.8e12)
