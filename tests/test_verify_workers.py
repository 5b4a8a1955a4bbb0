"""The recomputation check gives the same verdicts in one process and in several (trajectories
are independent; each worker runs its own single-threaded reference), and still catches a wrong
token or a wrong layer of KV."""
from __future__ import annotations

import pytest

from dualpath.model import Transformer
from dualpath.model.tiny import make_tiny_checkpoint
from dualpath.lifecycle.record import RequestRecord
from testbed.experiments.ablation import run_geometry, verify
from testbed.experiments.results import ModeResult
from testbed.cluster.verify import _layer_hashes


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ck") / "tiny", seed=0, kind="qwen2", num_hidden_layers=2)


def _runs(ckpt, modes=("basic", "dualpath", "oracle")) -> list[ModeResult]:
    """Three trajectories of three turns, with the tokens and KV hashes an honest engine reports."""
    import torch

    torch.set_num_threads(1)
    m = Transformer.from_pretrained(ckpt)
    geom = run_geometry(ckpt)
    system = [7 + i % 300 for i in range(70)]
    recs = []
    for tid in range(3):
        context = list(system)
        for t in range(3):
            prompt = context + [11 + tid + 5 * t + j for j in range(20 + 9 * t)]
            gen = m.generate(prompt, 4)
            n_hit = (len(context) // 32) * 32
            recs.append(dict(trajectory=tid, turn=t, prompt=prompt, gen_len=4, tokens=gen.tokens, n_hit=n_hit,
                             pe=_layer_hashes(gen.kv, geom, n_hit) if n_hit else [],
                             de=_layer_hashes(gen.kv, geom, len(prompt))))
            context = prompt + gen.tokens
    out = []
    for mode in modes:
        rs = [RequestRecord(f"{mode}-t{d['trajectory']}-r{d['turn']}", d["trajectory"], d["turn"], mode, "pe",
                            n_prompt=len(d["prompt"]), n_hit=d["n_hit"], gen_len=4, prompt=list(d["prompt"]),
                            tokens=list(d["tokens"]), pe_layer_hashes=list(d["pe"]), de_layer_hashes=list(d["de"]))
              for d in recs]
        out.append(ModeResult(mode, rs, 1.0, None, 0, 0.0, 0.0))
    return out


@pytest.mark.parametrize("workers", [1, 2])
def test_verdicts_in_one_process_and_in_two(ckpt, workers):
    geom = run_geometry(ckpt)
    results = _runs(ckpt)
    bad_tok = results[1].records[4]  # dualpath, trajectory 1, turn 1: a wrong token
    bad_tok.tokens[2] = (bad_tok.tokens[2] + 1) % 512
    bad_kv = results[0].records[8]  # basic, trajectory 2, turn 2: a wrong layer of the DE's KV
    bad_kv.de_layer_hashes[1] = "0" * 32
    verify(results, ckpt, geom, lambda _m: None, workers=workers)
    basic, dual, oracle = (r.verdicts for r in results)
    assert basic == {"requests": 9, "tokens_match": 9, "pe_kv_bit_exact": "9/9", "de_kv_bit_exact": "8/9",
                     "all_match": False, "first_mismatch": "basic-t2-r2",
                     "first_failed_check": {"request": "basic-t2-r2", "check": "de_kv_bit_exact", "layer": 1}}
    assert dual == {"requests": 9, "tokens_match": 8, "pe_kv_bit_exact": "9/9", "de_kv_bit_exact": "9/9",
                    "all_match": False, "first_mismatch": "dualpath-t1-r1",
                    "first_failed_check": {"request": "dualpath-t1-r1", "check": "tokens_match", "layer": None}}
    assert oracle == {"tokens": "n/a (oracle moves no KV)"}


def test_honest_runs_match(ckpt):
    results = _runs(ckpt, modes=("layerwise",))
    verify(results, ckpt, run_geometry(ckpt), lambda _m: None, workers=2)
    assert results[0].verdicts["all_match"] and results[0].verdicts["tokens_match"] == 9


def test_a_sample_checks_whole_trajectories_and_says_so(ckpt):
    from testbed.experiments.ablation import verified_trajectories

    results = _runs(ckpt, modes=("basic",))
    bad = results[0].records[4]  # trajectory 1, turn 1
    bad.tokens[0] = (bad.tokens[0] + 1) % 512
    keep = verified_trajectories(range(3), 2, seed=5)
    assert len(keep) == 2 and keep == verified_trajectories([2, 1, 0, 1], 2, seed=5)  # seeded, order-free
    verify(results, ckpt, run_geometry(ckpt), lambda _m: None, workers=1, sample=2, seed=5)
    v = results[0].verdicts
    assert v["sample"] == {"trajectories": 2, "of": 3, "seed": 5}
    assert v["requests"] == 6  # every turn of the two trajectories drawn
    assert v["all_match"] is (1 not in keep)  # the wrong token is caught exactly when its trajectory is drawn


@pytest.mark.parametrize("text, n", [("all", None), ("sample:4", 4)])
def test_verify_option(text, n):
    from testbed.experiments.ablation import parse_verify

    assert parse_verify(text) == n


@pytest.mark.parametrize("text", ["some", "sample:", "sample:0", "sample:x", "all:3"])
def test_verify_option_refuses_what_it_cannot_read(text):
    from testbed.experiments.ablation import parse_verify

    with pytest.raises(ValueError, match="expected all or sample:N"):
        parse_verify(text)


def test_recomputing_many_requests_together_is_bit_exact_with_each_alone(ckpt):
    import torch

    from testbed.cluster.verify import Reference

    geom = run_geometry(ckpt)
    prompts = [[7 + (i * j) % 300 for j in range(n)] for i, n in enumerate((5, 33, 64, 90))]
    together, alone = Reference(str(ckpt), geom), Reference(str(ckpt), geom)
    together.run_many([(p, 6) for p in prompts] + [(prompts[0], 6)])  # a repeat is computed once
    for p in prompts:
        a, b = together._cache[(tuple(p), 6)], alone.run(p, 6)
        assert a[0] == b[0] and len(a[0]) == 6
        assert all(torch.equal(x, y) for (k1, v1), (k2, v2) in zip(a[1], b[1]) for x, y in ((k1, k2), (v1, v2)))


def test_trajectories_are_shared_out_by_requests():
    from testbed.experiments.ablation import share_out

    per = {t: [((0, i), ("args", t, i)) for i in range(n)] for t, n in {1: 5, 2: 4, 3: 3, 4: 2, 5: 1}.items()}
    groups = share_out(per, 2)
    assert [sorted(g) for g in groups] == [[1, 4, 5], [2, 3]]  # 8 and 7 requests
    assert groups[0][1] == [("args", 1, i) for i in range(5)]  # in turn order, keys dropped
    assert len(share_out(per, 9)) == 5 and all(share_out(per, 9))  # no empty groups


def test_a_run_of_the_oracle_alone_has_nothing_to_recompute(ckpt):
    results = _runs(ckpt, modes=("oracle",))
    verify(results, ckpt, run_geometry(ckpt), lambda _m: None)
    assert results[0].verdicts == {"tokens": "n/a (oracle moves no KV)"}
