"""Real text end to end on a live 1p1d: a tiny random model that carries SmolLM2's tokenizer and
chat template runs two scripted conversations; records.jsonl has every request's decoded
prompt_text and output_text, the report shows one conversation, and tokens and KV still match
recomputation. (The real weights' run is `dualpath demo --model smollm2`: minutes, not a test.)"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO, needs_root, own_the_machine

pytestmark = needs_root
TOPO = REPO / "topologies" / "1p1d.yaml"


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory, smollm2_dir) -> Path:
    from dualpath.model.tiny import make_tiny_checkpoint

    d = make_tiny_checkpoint(tmp_path_factory.mktemp("ck") / "tiny-text", seed=0, kind="qwen2",
                             vocab_size=49152, num_hidden_layers=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / name, d / name)
    return d


def test_records_carry_the_text_of_every_request(text_ckpt, tmp_path):
    from dualpath.workload.text import decode, has_chat_template, text_workload
    from testbed.fabric.cleanup import find_leftovers
    from testbed.experiments.ablation import run_to_folder
    from testbed.paths import code_version
    from testbed.topology import load_topology

    assert has_chat_template(text_ckpt)
    wl = text_workload(text_ckpt, gen_len=3, n_conversations=2)
    own_the_machine()
    run_dir = tmp_path / "run"
    summary = run_to_folder(load_topology(TOPO), wl, text_ckpt, run_dir, "test", ("dualpath",), lambda _m: None)
    assert find_leftovers().empty()
    m = summary["modes"]["dualpath"]
    assert m["errors"] == 0 and m["verification"]["all_match"], m["verification"]
    assert summary["code"] == code_version() and json.loads((run_dir / "summary.json").read_text())["code"] == summary["code"]
    rows = [json.loads(x) for x in (run_dir / "records.jsonl").read_text().splitlines()]
    assert len(rows) == sum(t.n_turns for t in wl.trajectories) == m["requests"]
    for row in rows:
        assert "prompt" not in row and row["output_text"] == decode(row["tokens"], text_ckpt)
        assert row["prompt_text"].startswith(wl.system_text) and row["prompt_text"].endswith("<|im_start|>assistant\n")
        tr = wl.trajectories[row["trajectory"]]
        assert tr.turns[row["turn"]].message in row["prompt_text"]
    conv = summary["conversation"]
    assert conv["trajectory"] == 0 and len(conv["turns"]) == wl.trajectories[0].n_turns
    report = (run_dir / "report.md").read_text()
    assert "real text: conversation 0 (parser rejects empty input) in dualpath" in report
    assert "turn 0  in:  user The test `tests/test_parser.py" in report
