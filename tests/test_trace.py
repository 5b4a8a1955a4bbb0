"""Replaying a Mooncake-format trace (dualpath/workload/trace.py): the session rule, the hit count
straight from the file, arrivals, the workload vocabulary's refusals. No root needed."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from dualpath.workload import TraceError, hit_rate
from dualpath.workload.spec import WorkloadOptions, WorkloadSpec, resolve
from dualpath.workload.trace import (TraceSpec, block_keys, chain_sessions, load_trace, parse_window,
                                     trace_block_hit_rate)
from dualpath.workload.mooncake import load_mooncake

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake"


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def known_trace(n_sessions: int = 4, n_turns: int = 4, system_blocks: int = 2, gap_s: float = 4.0,
                stagger_s: float = 1.5, seed: int = 7) -> tuple[list[dict], list[list[int]]]:
    """Sessions of turns over a shared system prompt, each turn keeping the previous prompt's full
    blocks and replacing its partial tail: (rows sorted by time, the sessions as row indexes)."""
    rng = random.Random(seed)
    rows, owner, nid = [], [], [1000]
    for s in range(n_sessions):
        ids, n_in = list(range(1, system_blocks + 1)), system_blocks * 512
        for k in range(n_turns):
            ids = ids[:n_in // 512]
            n_in += rng.randint(300, 900)
            while len(ids) < -(-n_in // 512):
                nid[0] += 1
                ids.append(nid[0])
            rows.append({"timestamp": int((s * stagger_s + k * gap_s) * 1000), "input_length": n_in,
                         "output_length": rng.randint(20, 80), "hash_ids": list(ids)})
            owner.append((s, k))
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["timestamp"], i))
    sessions = [[order.index(i) for i in range(len(rows)) if owner[i][0] == s] for s in range(n_sessions)]
    sessions.sort(key=lambda x: x[0])
    return [rows[i] for i in order], sessions


def direct_count(rows: list[dict]) -> float:
    """The hit rate the prefixes allow, counted here independently of the module."""
    seen, hit, total = set(), 0, 0
    for r in rows:
        full = r["hash_ids"][:r["input_length"] // 512]
        prefixes = [tuple(full[:j + 1]) for j in range(len(full))]
        n = 0
        while n < len(prefixes) and prefixes[n] in seen:
            n += 1
        seen.update(prefixes)
        hit += 512 * n
        total += r["input_length"]
    return hit / total


def test_known_structure_is_recovered(tmp_path):
    rows, sessions = known_trace()
    p = write(tmp_path / "t.jsonl", rows)
    tw = load_trace(TraceSpec(str(p), length_scale=16), 32)
    assert [list(s) for s in tw.sessions] == sessions
    st = tw.stats()
    assert (st["requests"], st["sessions"], st["chained_turns"], st["turns_max"]) == (16, 4, 12, 4)
    assert st["trace_block_hit_rate"] == pytest.approx(direct_count(rows), abs=1e-6)


def test_most_recent_open_request_wins_and_is_then_taken():
    def req(i, ids, n_in):
        return {"timestamp": i, "input_length": n_in, "output_length": 1, "hash_ids": ids}

    rows = [req(0, [1, 2], 1024),  # 0: full ids [1, 2]
            req(1, [1, 2, 3], 1500),  # 1: continues 0 (0 is taken); its full ids are [1, 2]
            req(2, [7, 8], 1024),  # 2: a new session
            req(3, [1, 2, 3, 4], 2048),  # 3: continues 1 ([1, 2, 3] was a partial block there)
            req(4, [1, 2, 5], 1100),  # 4: 0 and 1 are taken, 3's full ids are not its prefix: new
            req(5, [9], 100),  # 5: no full block: continues nothing, and nothing can continue it
            req(6, [7, 8, 9], 1536),  # 6: continues 2
            req(7, [7, 8], 1024),  # 7: 2 is taken, 6's [7, 8, 9] is longer than it: new
            req(8, [7, 8, 9, 11], 2048)]  # 8: 6 and 7 both qualify and are open: the most recent, 7, wins
    reqs = load_mooncake_rows(rows)
    assert chain_sessions(reqs) == [[0, 1, 3], [2, 6], [4], [5], [7, 8]]


def load_mooncake_rows(rows, tmp=None):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return load_mooncake(write(Path(d) / "t.jsonl", rows))


def test_partial_tail_stays_partial_when_scaled(tmp_path):
    # 1023 tokens: one full block and a 511-token tail; / 16 rounds up to 64 = two whole blocks
    p = write(tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 1023, "output_length": 1, "hash_ids": [1, 2]}])
    r = load_mooncake(p, scale=16)[0]
    assert (r.full_blocks, r.full_ids, r.input_length) == (1, (1,), 63)
    assert len(block_keys(r, 32)) == 1


def test_block_keys_equal_exactly_where_tokens_are(tmp_path):
    rows, _ = known_trace(n_sessions=3, n_turns=3)
    reqs = load_mooncake(write(tmp_path / "t.jsonl", rows), scale=8)
    for a in reqs:
        for b in reqs:
            ka, kb = block_keys(a, 32), block_keys(b, 32)
            ta, tb = a.tokens(), b.tokens()
            same_keys = next((i for i, (x, y) in enumerate(zip(ka, kb)) if x != y), min(len(ka), len(kb)))
            same_blocks = next((i for i in range(min(len(ka), len(kb))) if ta[32 * i:32 * i + 32] != tb[32 * i:32 * i + 32]),
                               min(len(ka), len(kb)))
            assert same_keys == same_blocks


def test_tokens_hit_what_the_trace_count_allows(tmp_path):
    """The replayed prompts, with every full block stored as soon as its request is seen, hit what
    the count from the file says (in the run's tokens: a partial block's rounding aside)."""
    rows, _ = known_trace()
    tw = load_trace(TraceSpec(str(write(tmp_path / "t.jsonl", rows)), length_scale=16), 32)
    wl = tw.workload(32)
    order = sorted((tw.requests[i].index, sid, t) for sid, s in enumerate(tw.sessions) for t, i in enumerate(s))
    from dualpath.workload.trajectories import Trajectory
    flat = [Trajectory(n, (), (wl.trajectories[sid].turns[t],)) for n, (_, sid, t) in enumerate(order)]
    assert hit_rate(flat, 32) == pytest.approx(tw.stats()["trace_block_hit_rate"], abs=0.01)


def test_arrivals_from_timestamps_and_offline(tmp_path):
    rows, sessions = known_trace()
    p = str(write(tmp_path / "t.jsonl", rows))
    tw = load_trace(TraceSpec(p, length_scale=16, time_scale=2.0), 32)
    wl = tw.workload(32, seconds_per_emulated_s=3.0)
    tr = wl.trajectories[1]  # session 1 starts 1.5 trace s in, its turns every 4 s
    assert tr.arrival_s == pytest.approx(1.5 / 2 * 3)
    assert [u.at_s for u in tr.turns] == pytest.approx([0, 6, 12, 18])
    assert tw.stats()["offered"]["agents_per_s"] == pytest.approx(4 / ((max(r["timestamp"] for r in rows) / 1000) / 2), abs=1e-3)
    off = load_trace(TraceSpec(p, length_scale=16, offline=True), 32).workload(32)
    assert all(t.arrival_s == 0 and all(u.at_s is None for u in t.turns) for t in off.trajectories)
    # offline, the shared system prompt is the warm-up; online, one block no prompt shares
    assert [len(x) for x in off.warm_prompts] == [64]
    online = load_trace(TraceSpec(p, length_scale=16), 32).workload(32)
    assert len(online.warm_prompts) == 1 and len(online.warm_prompts[0]) == 32
    assert online.warm_prompts[0] != online.trajectories[0].turns[0].prompt[:32]


def test_window_limit_and_agents_select(tmp_path):
    rows, _ = known_trace()
    p = str(write(tmp_path / "t.jsonl", rows))
    assert load_trace(TraceSpec(p, length_scale=16, limit=5), 32).stats()["requests"] == 5
    w = load_trace(TraceSpec(p, length_scale=16, window=(4.0, 9.0)), 32)
    assert all(4.0 <= r.arrival_s < 9.0 for r in w.requests) and w.stats()["requests"] == 6
    a = load_trace(TraceSpec(p, length_scale=16, agents=2), 32)
    assert (a.stats()["sessions"], a.stats()["requests"]) == (2, 8)
    with pytest.raises(TraceError, match="no request in the window"):
        load_trace(TraceSpec(p, length_scale=16, window=(500.0, 600.0)), 32)


@pytest.mark.parametrize("opts, words", [
    (dict(trace="t.jsonl", workload="64K"), "--trace and --workload"),
    (dict(trace_limit=5), "--trace-limit applies to a replayed trace"),
    (dict(trace_window="0:9"), "--trace-window applies"),
    (dict(offline=True), "--offline applies"),
    (dict(workload="64K", time_scale=2.0), "--time-scale applies"),
    (dict(trace="t.jsonl", append_scale=2.0), "--append-scale applies to generated"),
    (dict(trace="t.jsonl", aps=1.0), "--aps"),
    (dict(trace="t.jsonl", offline=True, time_scale=2.0), "--time-scale and --offline"),
    (dict(trace="t.jsonl", length_scale=2.5), "whole number"),
    (dict(workload="100K"), "choose one of demo, 32K, 48K, 64K"),
    (dict(workload="demo", length_scale=4.0), "the demo workload has its own lengths"),
    (dict(trace="t.jsonl", trace_window="9"), "expected A:B"),
])
def test_conflicting_options_are_refused_in_one_line(opts, words):
    with pytest.raises(ValueError) as e:
        resolve(WorkloadOptions(**opts))
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("scale, run_block, words", [(3, 32, "must divide the trace block"),
                                                     (16, 48, "neither holds whole 48-token Full Blocks")])
def test_scale_that_does_not_make_whole_full_blocks_is_refused(tmp_path, scale, run_block, words):
    rows, _ = known_trace(n_sessions=1, n_turns=1)
    with pytest.raises(ValueError, match=words):
        load_trace(TraceSpec(str(write(tmp_path / "t.jsonl", rows)), length_scale=scale), run_block)


@pytest.mark.parametrize("scale", [32, 64])
def test_trace_blocks_smaller_than_a_full_block_still_replay(tmp_path, scale):
    """At / 32 a trace block is 16 tokens, half a Full Block: the keys still equal exactly where
    the tokens do; hits count whole Full Blocks only, so never more than the trace allows."""
    rows, _ = known_trace()
    tw = load_trace(TraceSpec(str(write(tmp_path / "t.jsonl", rows)), length_scale=scale), 32)
    reqs = tw.requests
    for a in reqs[:6]:
        for b in reqs[:6]:
            ka, kb = block_keys(a, 32), block_keys(b, 32)
            n = min(len(ka), len(kb))
            same = next((i for i in range(n) if ka[i] != kb[i]), n)
            ta, tb = a.tokens(), b.tokens()
            assert same == next((i for i in range(n) if ta[32 * i:32 * i + 32] != tb[32 * i:32 * i + 32]), n)
    wl = tw.workload(32)
    order = sorted((tw.requests[i].index, sid, t) for sid, s in enumerate(tw.sessions) for t, i in enumerate(s))
    from dualpath.workload.trajectories import Trajectory
    flat = [Trajectory(n, (), (wl.trajectories[sid].turns[t],)) for n, (_, sid, t) in enumerate(order)]
    assert 0 < hit_rate(flat, 32) <= tw.stats()["trace_block_hit_rate"]


def test_presets_and_defaults():
    assert resolve(WorkloadOptions()) is None
    s = resolve(WorkloadOptions(workload="64K", agents=8, gen_scale=2.0))
    assert s == WorkloadSpec(preset="64K", scale=32.0, agents=8, gen_scale=2.0)
    t = resolve(WorkloadOptions(trace="x.jsonl", trace_window="10:70", trace_limit=9, agents=3))
    assert (t.length_scale, t.window, t.limit, t.agents, t.offline) == (16, (10.0, 70.0), 9, 3, False)
    assert parse_window("0:1.5") == (0.0, 1.5)


def test_empty_trace_is_refused(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n\n")
    with pytest.raises(TraceError, match="holds no request"):
        load_trace(TraceSpec(str(p)), 32)


@pytest.mark.skipif(not (SHARED / "conversation_trace.jsonl").exists(), reason="shared/ traces not beside the repo")
def test_conversation_trace_count_matches_the_file():
    rows = [json.loads(x) for x in (SHARED / "conversation_trace.jsonl").read_text().splitlines()[:2000]]
    tw = load_trace(TraceSpec(str(SHARED / "conversation_trace.jsonl"), length_scale=16, limit=2000), 32)
    st = tw.stats()
    assert st["requests"] == 2000 and st["trace_block_hit_rate"] == pytest.approx(direct_count(rows), abs=1e-6)
    assert 0 < st["chained_turns"] < 2000 and st["sessions"] + st["chained_turns"] == 2000


BAD_TRACES = [
    ('{"timestamp": 0, "input_length": 10}\n', "field 'output_length': missing"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": []}\n', "must be >= 0"),
    ("not json\n", "not valid JSON"),
    ("\n", "holds no request"),
]


@pytest.mark.parametrize("command", ["sim", "run"])
@pytest.mark.parametrize("text, words", BAD_TRACES)
def test_every_command_gives_the_loaders_one_line(tmp_path, command, text, words):
    from tests.conftest import dualpath, is_root

    if command == "run" and not is_root():
        pytest.skip("dualpath run needs root (it refuses before reading the trace otherwise)")
    p = tmp_path / "bad.jsonl"
    p.write_text(text)
    r = dualpath(command, "topologies/1p1d-io.yaml", "--trace", str(p), "--modes", "dualpath",
                 "--out", str(tmp_path / "out"), timeout=120)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and words in err[0] and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_sim_refuses_conflicting_workload_options_in_one_line(tmp_path):
    from tests.conftest import dualpath

    r = dualpath("sim", "topologies/1p1d-io.yaml", "--trace", "x.jsonl", "--workload", "64K", timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "dualpath: --trace and --workload name two workloads; fix: give one of them"


def test_online_warm_up_persists_only_what_simultaneous_first_turns_share(tmp_path):
    """First turns sharing a system prompt that arrive together could not hit it (nothing written
    back yet): the warm-up persists it; spaced apart, the trace's own order does, and nothing is
    warmed."""
    rows, _ = known_trace(stagger_s=0.0)
    together = load_trace(TraceSpec(str(write(tmp_path / "a.jsonl", rows)), length_scale=16), 32)
    assert [len(p) for p in together.workload(32).warm_prompts] == [64]
    assert together.stats()["warm"] == {"prefixes": 1, "trace_tokens": 1024}
    rows, _ = known_trace(stagger_s=1.5)
    apart = load_trace(TraceSpec(str(write(tmp_path / "b.jsonl", rows)), length_scale=16), 32)
    assert apart.stats()["warm"]["prefixes"] == 0 and apart.warm_keys(32) == []


def test_a_trace_runs_summary_names_its_trace_again(tmp_path):
    """`sim --validate` re-reads a trace run's trace from its summary (testbed.sim.drive.trace_of_run)."""
    from testbed.sim.drive import trace_of_run

    rows, _ = known_trace()
    spec = TraceSpec(str(write(tmp_path / "t.jsonl", rows)), length_scale=16, window=(0.0, 9.0), time_scale=2.0)
    tw = load_trace(spec, 32)
    again = trace_of_run({"trace": json.loads(json.dumps(tw.stats()))})
    assert again.spec == spec and again.sessions == tw.sessions and again.stats() == tw.stats()
    assert trace_of_run({"modes": {}}) is None
