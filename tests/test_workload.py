"""Workload generator, paper presets, hit-rate estimate and the Mooncake trace loader."""
import json
import math

import pytest

from dualpath.workload import (
    RESERVED_TOKENS, TraceError, Trajectory, Turn, WorkloadConfig, demo_workload, generate, hit_rate,
    load_mooncake, paper_presets, poisson_arrivals, prefix_hit_rate, scaled, to_trajectories, turn_hits,
)
from dualpath.workload.mooncake import main as mooncake_main


def small(**kw) -> WorkloadConfig:
    base = dict(n_trajectories=6, turns_mean=5.0, turns_min=2, append_mean=20.0, gen_mean=8.0,
                system_prompt_len=64, max_len=4096, vocab_size=300, seed=7)
    base.update(kw)
    return WorkloadConfig(**base)


# ---------------------------------------------------------------- determinism


def test_same_seed_same_workload():
    a, b = generate(small()), generate(small())
    assert a.trajectories == b.trajectories
    assert a.system_prompt == b.system_prompt


def test_different_seed_differs():
    a, b = generate(small(seed=1)), generate(small(seed=2))
    assert a.system_prompt != b.system_prompt
    assert [t.turns for t in a] != [t.turns for t in b]


def test_trajectory_does_not_depend_on_how_many_are_generated():
    few, many = generate(small(n_trajectories=3)), generate(small(n_trajectories=9))
    assert few.trajectories == many.trajectories[:3]


# ---------------------------------------------------------------- shape


def test_system_prompt_shared_by_all_and_tokens_in_range():
    w = generate(small(n_trajectories=10))
    assert len(w.system_prompt) == 64
    for tr in w:
        assert tr.system_prompt == w.system_prompt
        for u in tr.turns:
            assert len(u.append) >= 1 and u.gen_len >= 1
            assert all(RESERVED_TOKENS <= x < 300 for x in u.append)
    assert all(RESERVED_TOKENS <= x < 300 for x in w.system_prompt)
    assert min(tr.n_turns for tr in w) >= 2  # turns_min, nothing truncated at max_len 4096


@pytest.mark.parametrize("dist", ["lognormal", "geometric"])
def test_means_close_to_requested(dist):
    cfg = small(n_trajectories=600, turns_mean=10.0, turns_min=3, append_mean=40.0, gen_mean=12.0,
                max_len=10**6, length_dist=dist, seed=3)
    st = generate(cfg).stats()
    assert st["turns_mean"] == pytest.approx(10.0, rel=0.05)
    assert st["append_mean"] == pytest.approx(40.0, rel=0.05)
    assert st["gen_mean"] == pytest.approx(12.0, rel=0.05)
    assert st["turns_min"] >= 3


def test_fixed_lengths_are_exact():
    w = generate(small(length_dist="fixed", turns_cv=0.0))
    for tr in w:
        assert tr.n_turns == 5
        assert all(len(u.append) == 20 and u.gen_len == 8 for u in tr.turns)


def test_truncation_at_max_len():
    cfg = small(n_trajectories=40, turns_mean=50.0, max_len=400)
    untruncated = generate(small(n_trajectories=40, turns_mean=50.0, max_len=10**6))
    w = generate(cfg)
    for tr, full in zip(w, untruncated):
        assert tr.final_len() <= 400
        k = tr.n_turns
        assert tr.turns == full.turns[:k]  # truncation cuts, never reshuffles
        if k < full.n_turns:  # the next turn would not have fit
            assert tr.final_len() + len(full.turns[k].append) + full.turns[k].gen_len > 400
    assert sum(tr.n_turns for tr in w) < sum(tr.n_turns for tr in untruncated)


def test_first_turn_always_kept():
    w = generate(small(system_prompt_len=60, max_len=64, append_mean=30.0))
    for tr in w:
        assert tr.n_turns >= 1 and tr.final_len() <= 64


def test_prompt_assembly():
    sp = (4, 5)
    tr = Trajectory(0, sp, (Turn((6, 7), 2), Turn((8,), 1), Turn((9, 10), 3)))
    assert tr.prompt(0, []) == [4, 5, 6, 7]
    assert tr.prompt(2, [[11, 12], [13]]) == [4, 5, 6, 7, 11, 12, 8, 13, 9, 10]
    assert tr.prompt_len(2) == 10 and tr.prompt_len(2, [5, 5]) == 17
    with pytest.raises(ValueError):
        tr.prompt(2, [[11, 12]])


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="vocab_size"):
        small(vocab_size=4)
    with pytest.raises(ValueError, match="max_len"):
        small(system_prompt_len=100, max_len=100)
    with pytest.raises(ValueError, match="turns_min"):
        small(turns_mean=1.0, turns_min=2)


# ---------------------------------------------------------------- hit rate


def test_hit_rule_by_hand():
    # S = 20, B = 16; turn 0 hits floor(20/16)*16 = 16 of its 25-token prompt.
    # After turn 0 the context is 20+5+3 = 28 tokens, 27 with KV -> turn 1 hits 16 of 28+4 = 32.
    # After turn 1: 28+4+10 = 42, 41 with KV -> turn 2 hits 32 of 42+1 = 43.
    tr = Trajectory(0, tuple(range(4, 24)), (Turn((4,) * 5, 3), Turn((4,) * 4, 10), Turn((4,), 1)))
    hits = list(turn_hits([tr], 16))
    assert [(h.prompt_len, h.hit) for h in hits] == [(25, 16), (32, 16), (43, 32)]
    assert hit_rate([tr], 16) == pytest.approx(64 / 100)


def test_last_generated_token_is_never_a_hit():
    # Context after turn 0 is exactly 32 = 2 blocks, but its last token has no KV: only 1 block hits.
    tr = Trajectory(0, tuple([4] * 16), (Turn((4,) * 8, 8), Turn((4,), 1)))
    assert [h.hit for h in turn_hits([tr], 16)] == [16, 16]


def test_gen_tokens_fn_overrides_planned_lengths():
    tr = Trajectory(0, tuple([4] * 16), (Turn((4,) * 8, 8), Turn((4,), 1)))
    # the model actually generated 9 tokens in turn 0 -> 33 context, 32 with KV -> 2 blocks hit
    assert [h.hit for h in turn_hits([tr], 16, lambda t, i: 9)] == [16, 32]


def test_demo_workload():
    cfg = demo_workload()
    w = generate(cfg)
    st = w.stats(16)
    assert st["trajectories"] >= 20 and st["turns_min"] >= 8
    assert cfg.system_prompt_len == 512 and cfg.vocab_size == 512 and cfg.max_len == 2048
    assert 18 <= st["append_mean"] <= 30 and 4 <= st["gen_mean"] <= 8
    assert st["prompt_len_mean"] > 80 * st["gen_mean"]  # reads dominate, as in the paper's traces
    assert st["prompt_len_max"] <= 2048
    assert hit_rate(w.trajectories, 16) >= 0.9


# ---------------------------------------------------------------- paper presets


def test_paper_presets_statistics():
    p = paper_presets()
    assert set(p) == {"32K", "48K", "64K"}
    l = p["64K"]
    assert (l.turns_mean, l.append_mean, l.gen_mean, l.max_len, l.hit_rate) == (157, 429, 176, 65536, 0.987)
    assert l.hit_rate == pytest.approx(l.context_mean / (l.context_mean + l.append_mean), abs=5e-4)
    assert (p["32K"].turns_mean, p["32K"].append_mean) == (60, 608)
    assert (p["48K"].turns_mean, p["48K"].append_mean) == (106, 474)
    assert all(x.n_trajectories == 500 for x in p.values())


def test_scaled_divides_lengths_and_records_factor():
    c = scaled("64K", 16, n_trajectories=5)
    assert c.scale_factor == 16 and "16" in c.name
    assert c.max_len == 4096 and c.append_mean == pytest.approx(429 / 16) and c.gen_mean == 11.0
    assert c.turns_mean == 157  # counts are not lengths
    c32 = scaled("32K", 8)
    assert any("assumed" in n for n in c32.notes) and c32.gen_mean == 176 / 8
    with pytest.raises(ValueError):
        scaled("64K", 0.5)


def test_unscaled_64k_reproduces_paper_context_and_hit_rate():
    """Generating the 64K set at paper scale (64-token blocks as in the paper) lands near the
    paper's average context (32,721) and hit rate (98.7 %)."""
    w = generate(scaled("64K", 1, n_trajectories=40, seed=1))
    st = w.stats(64)
    assert st["prompt_len_mean"] == pytest.approx(32721, rel=0.10)
    assert st["hit_rate"] == pytest.approx(0.987, abs=0.004)


def test_poisson_arrivals():
    a = poisson_arrivals(2000, aps=4.0, seed=1)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert (len(a) - 1) / a[-1] == pytest.approx(4.0, rel=0.08)
    assert a == poisson_arrivals(2000, aps=4.0, seed=1) != poisson_arrivals(2000, aps=4.0, seed=2)


# ---------------------------------------------------------------- Mooncake traces

ROWS = [
    {"timestamp": 0, "input_length": 1100, "output_length": 40, "hash_ids": [0, 1, 2]},
    {"timestamp": 0, "input_length": 1300, "output_length": 33, "hash_ids": [0, 1, 3]},
    {"timestamp": 2500, "input_length": 700, "output_length": 0, "hash_ids": [4, 5], "extra": "ignored"},
]


def write(tmp_path, lines, name="trace.jsonl"):
    p = tmp_path / name
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return p


def test_mooncake_round_trip(tmp_path):
    p = write(tmp_path, [ROWS[0], "", ROWS[1], ROWS[2]])
    reqs = load_mooncake(p, scale=4, vocab_size=300)
    assert [r.line for r in reqs] == [1, 3, 4]
    assert [r.arrival_s for r in reqs] == [0.0, 0.0, 2.5]
    assert [r.input_length for r in reqs] == [275, 325, 175]
    assert [r.output_length for r in reqs] == [10, 9, 0]
    t0, t1, t2 = (r.tokens() for r in reqs)
    assert [len(t) for t in (t0, t1, t2)] == [275, 325, 175]
    assert all(RESERVED_TOKENS <= x < 300 for x in t0 + t1 + t2)
    # hash ids 0, 1 shared -> exactly two 128-token blocks shared, then different
    assert t0[:256] == t1[:256] and t0[256] != t1[256]
    assert t2[:16] != t0[:16]
    assert load_mooncake(p, scale=4, vocab_size=300)[1].tokens() == t1  # deterministic
    trajs = to_trajectories(reqs)
    assert [tr.arrival_s for tr in trajs] == [0.0, 0.0, 2.5]
    assert trajs[1].turns[0].append == t1 and trajs[2].turns[0].gen_len == 1
    # infinite-cache hit: request 1 hits its 2 shared 128-token blocks = 256 of 325 tokens
    assert prefix_hit_rate(reqs, 16) == pytest.approx(256 / (275 + 325 + 175))


def test_mooncake_shorter_hash_list_gets_unique_tail(tmp_path):
    p = write(tmp_path, [{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [9]},
                         {"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": [9]}])
    a, b = (r.tokens() for r in load_mooncake(p))
    assert a[:512] == b[:512] and a[512:] != b[512:]


BAD = [
    ("{not json", None, "not valid JSON"),
    ("[1, 2]", None, "expected a JSON object"),
    ({"input_length": 5, "output_length": 1, "hash_ids": [0]}, "timestamp", "missing"),
    ({"timestamp": 0, "output_length": 1, "hash_ids": [0]}, "input_length", "missing"),
    ({"timestamp": 0, "input_length": 5, "hash_ids": [0]}, "output_length", "missing"),
    ({"timestamp": 0, "input_length": 5, "output_length": 1}, "hash_ids", "missing"),
    ({"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}, "input_length", ">= 1"),
    ({"timestamp": 0, "input_length": 5, "output_length": -1, "hash_ids": [0]}, "output_length", ">= 0"),
    ({"timestamp": -3, "input_length": 5, "output_length": 1, "hash_ids": [0]}, "timestamp", ">= 0"),
    ({"timestamp": "0", "input_length": 5, "output_length": 1, "hash_ids": [0]}, "timestamp", "number"),
    ({"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": [0]}, "input_length", "integer"),
    ({"timestamp": 0, "input_length": 5.5, "output_length": 1, "hash_ids": [0]}, "input_length", "integer"),
    ({"timestamp": 0, "input_length": True, "output_length": 1, "hash_ids": [0]}, "input_length", "integer"),
    ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "0,1"}, "hash_ids", "list"),
    ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0, "x"]}, "hash_ids", "entry 1"),
    ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-1]}, "hash_ids", "entry 0"),
    ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0, 1]}, "hash_ids", "spans only 1"),
]


@pytest.mark.parametrize("bad,field,words", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_mooncake_bad_input_names_file_line_field(tmp_path, capsys, bad, field, words):
    p = write(tmp_path, [ROWS[0], ROWS[1], bad])
    with pytest.raises(TraceError) as ei:
        load_mooncake(p)
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg.startswith(f"{p}:3: ")
    assert words in msg
    if field is not None:
        assert f"field '{field}'" in msg
    assert ei.value.line == 3 and ei.value.field == field
    # the command line prints exactly that one line, no traceback
    assert mooncake_main([str(p)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: {msg}" and "Traceback" not in err


def test_mooncake_missing_file_and_bad_scale(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        load_mooncake(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="scale"):
        load_mooncake(write(tmp_path, [ROWS[0]]), scale=3)


def test_mooncake_not_utf8(tmp_path):
    p = tmp_path / "bin.jsonl"
    p.write_bytes(json.dumps(ROWS[0]).encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceError, match=r":2: not UTF-8"):
        load_mooncake(p)


def test_mooncake_cli_summary(tmp_path, capsys):
    p = write(tmp_path, ROWS)
    assert mooncake_main([str(p), "--scale", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 3 and out["block_tokens"] == 128
    assert math.isclose(out["duration_s"], 2.5)
