"""The simulator replaying a Mooncake-format trace (simulator/cluster.py's trace agents,
testbed/sim/drive.py's trace_trajectories / simulate(trace=) / run_sim_to_folder(trace=)): one store of
block keys shared by every agent, turns at their trace times but never before the previous
answer, and a run's hit rate against the one the trace's prefixes allow."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath.workload.trace import TraceSpec, load_trace
from simulator.calibration import UNCALIBRATED
from simulator.agents import TraceTurn, TrajectorySpec
from simulator.cluster import ClusterSim
from testbed.cluster.modes import PATH_POLICY, connector_of
from testbed.sim.drive import RUN_BLOCK_TOKENS, run_sim_to_folder, sim_config, simulate, trace_summary, trace_trajectories
from testbed.topology import load_topology

ROOT = Path(__file__).resolve().parent.parent
TOPO = ROOT / "topologies" / "1p1d-io.yaml"
# CI clones the repository beside shared/; a session's checkout sits in /work/main beside /work/shared
CONVERSATION = ROOT.parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"


def _cfg(units: str = "testbed"):
    topo = load_topology(TOPO, carried=True)
    return topo, sim_config(topo, units=units, cal=UNCALIBRATED)


def _sim(cfg, mode: str, trajs, warm=()):
    return ClusterSim(cfg, mode, connector_of(mode), PATH_POLICY[mode], trajs, warm_keys=warm).run()


# --------------------------------------------------------------------------- the shared store


@pytest.mark.parametrize("mode", ["dualpath", "oracle"])
def test_trace_turns_hit_the_leading_run_of_their_keys_in_one_store_capped_at_one_computed_token(mode):
    _, cfg = _cfg()
    bs = cfg.block_size
    turns = [TraceTurn(3 * bs + 5, 4, (1, 2, 3), None),  # warm-up holds 1, 2: two blocks hit
             TraceTurn(4 * bs, 4, (1, 2, 3, 4), None),  # 1, 2, 3 persisted by the first turn
             TraceTurn(4 * bs, 4, (1, 2, 3, 4), None),  # all four stored: capped at (4 bs - 1) // bs = 3
             TraceTurn(2 * bs + 1, 4, (1, 9), None)]  # a run stops at its first unknown key
    other = [TraceTurn(2 * bs + 3, 4, (7, 8), None)]  # another agent's keys: the warm-up's 7, not 8's run
    # the first turn's prompt again, in the same instant: block 3 is not persisted before its write-back
    twin = [TraceTurn(3 * bs + 5, 4, (1, 2, 3), None)]
    res = _sim(cfg, mode, [TrajectorySpec(0, 0, [(t.prompt_len, t.gen_len) for t in turns], 0.0, turns),
                           TrajectorySpec(1, 0, [(0, 0)], 0.0, other), TrajectorySpec(2, 0, [(0, 0)], 0.0, twin)],
               warm=[(1, 2), (7,)])
    hits = {(r.trajectory, r.turn): r.n_hit // bs for r in res.records}
    assert hits == {(0, 0): 2, (0, 1): 3, (0, 2): 3, (0, 3): 1, (1, 0): 1, (2, 0): 2}
    for r in res.records:
        assert r.n_prompt == r.n_hit + r.n_miss and len(r.token_times) == r.gen_len


def test_an_agent_without_trace_turns_keeps_its_own_context_store():
    """The generated workload's model is untouched: a per-trajectory spec next to a trace agent
    hits its own system prompt and previous turns, whatever the shared store holds."""
    _, cfg = _cfg()
    bs = cfg.block_size
    res = _sim(cfg, "dualpath", [TrajectorySpec(0, 4 * bs, [(40, 8), (40, 8)]),
                                 TrajectorySpec(1, 0, [(0, 0)], 0.0, [TraceTurn(2 * bs, 4, (5, 6), None)])],
               warm=[(5, 6)])
    by = {(r.trajectory, r.turn): r for r in res.records}
    assert by[0, 0].n_hit == 4 * bs  # the system prompt
    assert by[0, 1].n_hit == (4 * bs + 40 + 8) // bs * bs  # the whole previous context, written back
    assert by[1, 0].n_hit == bs  # (2 bs - 1) // bs


# --------------------------------------------------------------------------- a hand-made trace


def _line(ts_ms: float, n_in: int, ids: list[int], n_out: int = 64) -> str:
    return json.dumps({"timestamp": ts_ms, "input_length": n_in, "output_length": n_out, "hash_ids": ids})


def _hand_trace(path: Path) -> Path:
    """Four sessions by the trace's rule (dualpath.workload.trace), sharing trace block 0 (and
    C shares A's first two blocks), arrivals 20 s apart but for D, whose second turn's timestamp
    falls before its first turn can have answered."""
    lines = [
        _line(0, 3 * 512 + 100, [0, 1, 2, 3]),  # A1
        _line(20_000, 3 * 512 + 100, [0, 10, 11, 12]),  # B1: hits block 0
        _line(40_000, 5 * 512 + 10, [0, 1, 2, 4, 5, 6]),  # A2: continues A1 (hits 0, 1, 2)
        _line(60_000, 4 * 512 + 300, [0, 10, 11, 12, 13]),  # B2
        _line(80_000, 6 * 512 + 1, [0, 1, 2, 4, 5, 7, 8]),  # A3
        _line(100_000, 2 * 512 + 5, [0, 1, 20]),  # C: continues nothing, hits 0, 1
        _line(120_000, 5 * 512 + 100, [0, 10, 11, 12, 13, 30]),  # B3
        _line(140_000, 2 * 512 + 50, [40, 41, 42], n_out=512),  # D1
        _line(140_001, 3 * 512 + 50, [40, 41, 42, 43]),  # D2: due 1 ms after D1 arrives
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_hand_made_trace_runs_every_turn_in_order_and_hits_what_its_prefixes_allow(tmp_path):
    topo, cfg = _cfg()
    tw = load_trace(TraceSpec(str(_hand_trace(tmp_path / "t.jsonl")), length_scale=16), RUN_BLOCK_TOKENS)
    assert [len(s) for s in tw.sessions] == [3, 3, 1, 2]
    trajs = trace_trajectories(tw, cfg)
    res = simulate(cfg, None, ["basic", "dualpath"], trace=tw)
    for m, r in res.items():
        assert len(r.records) == len(tw.requests) and not any(x.error for x in r.records)
        got = {(x.trajectory, x.turn): x for x in r.records}
        for tr in trajs:
            for t, turn in enumerate(tr.trace_turns):
                rec = got[tr.id, t]
                assert rec.n_prompt == turn.prompt_len and len(rec.token_times) == turn.gen_len
                due = r.t0 + tr.arrival_s + turn.at_s
                after = got[tr.id, t - 1].t_done if t else r.t0
                assert rec.t_arrive == pytest.approx(max(due, after), rel=1e-12, abs=1e-9), (m, tr.id, t)
                assert rec.t_arrive >= due - 1e-9 and rec.t_arrive >= after and rec.t_done > rec.t_arrive
        d1, d2 = got[3, 0], got[3, 1]
        assert d2.t_arrive == d1.t_done  # D2's trace time passed while D1 ran: it starts on D1's answer
    ts = trace_summary(tw, res)
    assert ts["trace_block_hit_rate"] == tw.hits["rate"] > 0.3
    assert ts["run_hit_rate"] == pytest.approx(ts["trace_block_hit_rate"], abs=0.01)
    for m in res:
        assert ts["run_hit_rate_by_mode"][m] == pytest.approx(ts["trace_block_hit_rate"], abs=0.01)
    # the leading runs themselves, in Full Blocks (a trace block is one 32-token Full Block at /16)
    a = {(x.trajectory, x.turn): x.n_hit // cfg.block_size for x in res["dualpath"].records}
    assert a == {(0, 0): 0, (0, 1): 3, (0, 2): 5, (1, 0): 1, (1, 1): 3, (1, 2): 4, (2, 0): 2, (3, 0): 0, (3, 1): 2}


def test_the_run_folder_carries_the_trace_and_its_hit_rates(tmp_path):
    topo, _ = _cfg()
    tw = load_trace(TraceSpec(str(_hand_trace(tmp_path / "t.jsonl")), length_scale=16), RUN_BLOCK_TOKENS)
    said: list[str] = []
    s = run_sim_to_folder(topo, None, ["dualpath"], tmp_path / "run", "test", trace=tw, progress=said.append)
    tr = s["trace"]
    assert tr["requests"] == 9 and tr["sessions"] == 4 and tr["trace_block_hit_rate"] == tw.hits["rate"]
    assert tr["run_hit_rate"] == tr["run_hit_rate_by_mode"]["dualpath"] > 0.3
    assert tr["run_hit_rate"] == pytest.approx(s["modes"]["dualpath"]["hit_rate"], abs=5e-5)  # that one has 4 digits
    assert s["workload"]["name"] == "trace" and s["modes"]["dualpath"]["requests"] == 9
    assert s["modes"]["dualpath"]["simulation"]["requests_per_wall_s"] > 0
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["trace"]["run_hit_rate"] == tr["run_hit_rate"]
    assert len((tmp_path / "run" / "records.jsonl").read_text().splitlines()) == 9
    assert any("9 requests" in x for x in said) and any("hit rate" in x for x in said)
    with pytest.raises(ValueError, match="aps"):
        run_sim_to_folder(topo, None, ["dualpath"], tmp_path / "run2", "test", trace=tw, aps=1.0)


# --------------------------------------------------------------------------- the conversation trace


def _direct_block_hit_rate(path: Path, limit: int) -> float:
    """The trace's block hit rate counted straight from its JSON lines: a request hits the
    leading full trace blocks whose prefix some earlier request's full blocks held."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    with open(path) as f:
        for n, line in enumerate(f):
            if n >= limit:
                break
            d = json.loads(line)
            full = d["hash_ids"][:d["input_length"] // 512]
            k = 0
            while k < len(full) and tuple(full[:k + 1]) in seen:
                k += 1
            seen.update(tuple(full[:j + 1]) for j in range(len(full)))
            hit += 512 * k
            total += d["input_length"]
    return hit / total


def test_the_conversation_traces_first_2000_requests_offline(tmp_path):
    if not CONVERSATION.is_file():
        pytest.skip(f"{CONVERSATION} is not here (shared/ beside the checkout)")
    topo, cfg = _cfg()
    tw = load_trace(TraceSpec(str(CONVERSATION), length_scale=16, limit=2000, offline=True), RUN_BLOCK_TOKENS)
    s = run_sim_to_folder(topo, None, ["dualpath"], tmp_path / "run", "test", trace=tw)
    tr = s["trace"]
    want = _direct_block_hit_rate(CONVERSATION, 2000)
    assert tr["requests"] == 2000 and s["modes"]["dualpath"]["requests"] == 2000
    assert s["modes"]["dualpath"]["errors"] == 0
    assert tr["trace_block_hit_rate"] == pytest.approx(want, abs=1e-6) and want > 0.1
    # offline, requests that share a prefix run at once and miss what the others have not yet
    # written back (the warm-up persists only the first turns' shared prefixes): fewer hits
    assert 0.5 * want < tr["run_hit_rate"] <= want + 0.01


def test_a_trace_whose_prompts_no_engine_could_hold_is_refused_instead_of_waiting_for_ever(tmp_path):
    """Target units on 1p1d-io: an H800's HBM left by Qwen2.5-32B's weights is 24,689 tokens of its
    KV; a prompt longer than that is never admitted, and the simulation would never end."""
    topo, cfg = _cfg("target")
    assert cfg.hbm_tokens == 24689
    path = tmp_path / "t.jsonl"
    path.write_text(_line(0, 1000, [0]) + "\n" + _line(1000, 25000 * 16, list(range(1, 783))) + "\n")
    tw = load_trace(TraceSpec(str(path), length_scale=16), RUN_BLOCK_TOKENS)
    with pytest.raises(ValueError, match=r"1 of the trace's 2 requests can never run.*HBM \(\d+ tokens"):
        simulate(cfg, None, ["dualpath"], trace=tw)
