"""dualpath profile: the compute-quota cost model fitted on the engine's own prefill loop."""
import pytest


def test_profile_fits_a_cost_model_on_the_engine_loop(tmp_path):
    from dualpath.model.tiny import make_tiny_checkpoint
    from testbed.calibrate.profile import profile

    res = profile(make_tiny_checkpoint(tmp_path / "ckpt"), quota_s=0.05, reps=1)
    m = res["cost_model"]
    assert all(v >= 0 for v in m.values()) and m["per_new"] > 0
    from dualpath.scheduler.cost_model import AttentionCostModel

    fit = AttentionCostModel.from_dict(m)
    ex = res["example_chunk"]
    k = ex["largest_chunk_in_quota"]
    assert fit.request_cost(ex["cached"], k) <= 0.05 < fit.request_cost(ex["cached"], k + 1)
    assert res["beta_tokens_at_5s"] == pytest.approx(5 * res["prefill_tokens_per_s"])
