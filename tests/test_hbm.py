"""The target's HBM as a limit: pass packing, never-fitting requests, budgets per target."""
from __future__ import annotations

import pytest

from dualpath.scheduler.batching import PrefillItem, PrefillQueue, pack_batch
from dualpath.scheduler.cost_model import AttentionCostModel
from dualpath.scheduler.hbm import DecodeHbm, HbmLimit, HbmPlan, NeverFits
from emulators.gpu.cost import Target, target
from emulators.gpu.memory import LAYERS_IN_FLIGHT, RESERVE_SHARE, hbm_budget
from emulators.gpu.specs import GpuSpec

FREE = AttentionCostModel(per_new=1e-9)  # a quota that never binds: HBM alone decides
WHOLE = HbmLimit(budget_bytes=250, past_bytes_per_token=1, new_bytes_per_token=1)
LAYER = HbmLimit(budget_bytes=250, past_bytes_per_token=0.1, new_bytes_per_token=1)


def _queue(n: int, cached: int = 100, new: int = 10) -> list[PrefillItem]:
    return [PrefillItem(f"r{i}", cached, new) for i in range(n)]


def test_a_whole_past_pass_takes_only_the_requests_whose_kv_fits():
    b = pack_batch(_queue(5), FREE, 1.0, WHOLE)
    # 110 bytes each: two fit 250, the third's past (100) fits the 30 left only without its new tokens
    assert [e.request_id for e in b.entries] == ["r0", "r1"]
    assert b.hbm_limited and b.hbm_bytes == 220 and b.batch_tokens == 220


def test_layer_blocks_hold_a_tenth_of_the_past_so_five_requests_fit():
    b = pack_batch(_queue(5), FREE, 1.0, LAYER)
    assert len(b.entries) == 5 and all(e.last for e in b.entries)
    assert not b.hbm_limited and b.hbm_bytes == pytest.approx(5 * 20)


def test_hbm_chunks_the_head_to_the_new_tokens_that_fit():
    b = pack_batch([PrefillItem("a", 100, 10), PrefillItem("b", 100, 200)], FREE, 1.0, WHOLE)
    assert [(e.request_id, e.new, e.last) for e in b.entries] == [("a", 10, True), ("b", 40, False)]
    assert b.hbm_limited and b.hbm_bytes == 250


def test_the_quota_still_binds_where_hbm_does_not():
    quota = AttentionCostModel(per_new=0.01)  # 10 new tokens cost 0.1 s
    b = pack_batch(_queue(5), quota, 0.25, LAYER)
    assert [e.new for e in b.entries] == [10, 10, 5] and not b.hbm_limited


def test_without_a_limit_nothing_changes():
    assert pack_batch(_queue(5), FREE, 1.0).entries == pack_batch(_queue(5), FREE, 1.0, None).entries
    assert pack_batch(_queue(5), FREE, 1.0).hbm_bytes == 0


def test_a_request_no_pass_can_hold_is_refused_on_push_naming_it_and_the_budget():
    q = PrefillQueue(FREE, 1.0, WHOLE)
    with pytest.raises(NeverFits, match=r"request big: its 300-token prompt needs .* more than its KV budget"):
        q.push("big", 250, 50)
    q.push("ok", 200, 50)  # 250 bytes on its last token: fits alone
    assert len(q) == 1
    with pytest.raises(NeverFits, match="request past"):  # a past that fits no pass even unpushed
        pack_batch([PrefillItem("past", 300, 1)], FREE, 1.0, WHOLE)


def test_a_queue_drains_in_passes_the_budget_allows():
    q = PrefillQueue(FREE, 1.0, WHOLE)
    for i in range(5):
        q.push(f"r{i}", 100, 10)
    sizes = []
    while len(q):
        sizes.append(len(q.next_batch().entries))
    assert sizes == [2, 2, 1]


def test_decode_budget_counts_tokens_and_refuses_one_that_never_fits():
    d = DecodeHbm(budget_bytes=1000, kv_bytes_per_token=10)
    assert d.tokens == 100
    d.check_request("fits", 100)
    with pytest.raises(NeverFits, match=r"request long: its 101 tokens of KV .* \(100 tokens"):
        d.check_request("long", 101)
    assert d.batch_record(60, 2) == {"batch_tokens": 60, "hbm_peak_bytes": 600, "hbm_limited": False}
    assert d.batch_record(80, 2)["hbm_limited"]  # 80 + a 40-token request > 100
    plan = HbmPlan(WHOLE, LAYER, d)
    assert plan.prefill("basic") is WHOLE and plan.prefill("layerwise") is LAYER and plan.prefill("oracle") is LAYER
    with pytest.raises(NeverFits, match="decode"):
        plan.check_request("r", 60, 50, "layerwise")  # its prompt fits a pass, its 110 tokens no decode batch


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan")])
def test_a_limit_refuses_meaningless_numbers(bad):
    with pytest.raises(ValueError, match="must be finite and > 0"):
        HbmLimit(bad, 1, 1)


def test_qwen_on_h800_leaves_6_5_gb_and_24689_tokens_for_kv():
    b = hbm_budget(target("h800", "qwen2.5-32b"))
    assert b.weight_bytes == pytest.approx(65.53e9, rel=1e-3)
    assert b.budget_bytes == pytest.approx(80e9 * (1 - RESERVE_SHARE) - b.weight_bytes)
    assert b.decode().tokens == int(b.budget_bytes // 262144) == 24689
    # Basic holds every layer of the past; Layer Blocks LAYERS_IN_FLIGHT of its 64 layers
    basic, lw = b.largest_batch_tokens(2048, True), b.largest_batch_tokens(2048, False)
    assert basic == 12 * 2049
    assert lw // 2049 == int(b.budget_bytes // (2048 * 262144 * LAYERS_IN_FLIGHT / 64 + 262144))


def test_deepseek_660b_splits_its_experts_and_counts_the_indexer_key():
    b = hbm_budget(target("h800", "deepseek-v3.2"))
    assert b.kv_bytes_per_token == 40016 + 8052
    assert 10e9 < b.budget_bytes < 15e9  # 58.8 GB of weights per GPU at EP 16
    assert b.largest_batch_tokens(65536, True) // 65537 == 4  # the paper's 64K context: 4 requests in Basic


def test_deepseek_660b_decodes_on_a_group_twice_its_prefill_groups_so_holds_more_kv_there():
    b = hbm_budget(target("h800", "deepseek-v3.2"))
    m = target("h800", "deepseek-v3.2").model
    assert (m.ep, m.decode_ep) == (16, 32)
    assert b.decode_weight_bytes == pytest.approx(m.weight_bytes(32)) and b.decode_weight_bytes < b.weight_bytes
    assert b.decode_budget_bytes - b.budget_bytes == pytest.approx(b.weight_bytes - b.decode_weight_bytes)
    assert b.decode().tokens == int(b.decode_budget_bytes // b.kv_bytes_per_token)
    q = hbm_budget(target("h800", "qwen2.5-32b"))  # one full copy per GPU on both sides
    assert q.decode_budget_bytes == q.budget_bytes


def test_a_length_scaled_workload_gets_the_budget_over_its_scale_so_as_many_requests_fit():
    full, scaled = hbm_budget(target("h800", "deepseek-v3.2")), hbm_budget(target("h800", "deepseek-v3.2"), 32)
    assert scaled.budget_bytes == pytest.approx(full.budget_bytes / 32)
    assert scaled.decode_budget_bytes == pytest.approx(full.decode_budget_bytes / 32)
    # the target's 64K context and the testbed's 2,048 (64K / 32): the same 4 requests in a Basic pass
    assert scaled.largest_batch_tokens(2048, True) // 2049 == full.largest_batch_tokens(65536, True) // 65537 == 4
    assert full.largest_batch_tokens(2048, True) // 2049 > 100  # unscaled, lengths / 32 leave 32x the room


def test_a_length_scale_that_leaves_no_token_is_an_error_saying_so():
    with pytest.raises(ValueError, match="leave no HBM for KV on a 80 GB GPU once divided by the length scale 1e"):
        hbm_budget(target("h800", "qwen2.5-32b"), 1e6)


def test_a_target_whose_weights_fill_the_gpu_is_an_error_naming_it():
    small = GpuSpec("small", bf16_flops=1e15, hbm_bytes_per_s=1e12, hbm_bytes=40e9)
    with pytest.raises(ValueError, match=r"target small/qwen2.5-32b: its weights \(65.5 GB per GPU\)"):
        hbm_budget(Target(small, target("h800", "qwen2.5-32b").model))


def test_the_testbeds_own_buffer_caps_the_decode_budget_when_it_holds_fewer():
    d = DecodeHbm(budget_bytes=1000, kv_bytes_per_token=10, cap_tokens=40)
    assert (d.target_tokens, d.tokens) == (100, 40)
    with pytest.raises(NeverFits, match="the 40 tokens the testbed's own HBM buffer holds"):
        d.check_request("r", 41)
    assert DecodeHbm(1000, 10, cap_tokens=500).tokens == 100


def test_batch_sizes_give_each_modes_distribution_and_how_many_hbm_filled():
    from testbed.measure.metrics import batch_sizes

    recs = [{"n": n, "batch_tokens": 100 * n, "hbm_peak_bytes": 1000 * n, "hbm_limited": n == 10} for n in range(1, 11)]
    b = batch_sizes(recs)
    assert b["batches"] == 10 and b["requests"] == {"p50": 6, "p90": 10, "max": 10}
    assert b["tokens"]["max"] == 1000 and b["hbm_peak_bytes"] == 10000 and b["hbm_limited"] == 1
    assert batch_sizes([]) is None
    assert batch_sizes([{"n": 2}])["hbm_peak_bytes"] is None  # a run from before the budget
