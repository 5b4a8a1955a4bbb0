"""What is committed under results/ was produced by a command and, where it is a run in emulated
time, judged FAITHFUL (DEVELOPERS' rule: commit a reference run only when it is FAITHFUL)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Runs whose times come from the emulated clock carry a fidelity verdict; link and disk
# calibrations (bench, check, profile) measure the host's own rates and carry none.
TIMED = ("e2e", "reproduce", "sim")


def committed_summaries() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.stdout.split() if p.endswith("summary.json")]


@pytest.mark.parametrize("path", committed_summaries(), ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_result_names_its_command_and_is_faithful(path: Path):
    s = json.loads(path.read_text())
    assert s.get("command"), f"{path} does not name the command that produced it"
    kind = path.relative_to(ROOT / "results").parts[0]
    if kind in TIMED:
        assert is_faithful(s), f"{path}: a committed run in emulated time must be FAITHFUL"


def is_faithful(summary: dict) -> bool:
    """A reproduce or sim summary carries one verdict; a `dualpath run` carries one per mode."""
    if "faithful" in summary:
        # an id that used no testbed run (models, generators, the simulator) has no verdict: null
        return summary["faithful"] is True or (summary["faithful"] is None and not summary.get("runs"))
    modes = summary.get("modes")
    return bool(modes) and all(m.get("faithful") is True for m in modes.values())


def test_a_run_with_one_unfaithful_mode_is_not_faithful():
    assert is_faithful({"modes": {"basic": {"faithful": True}, "dualpath": {"faithful": True}}})
    assert not is_faithful({"modes": {"basic": {"faithful": True}, "dualpath": {"faithful": False}}})
    assert not is_faithful({"modes": {}}) and not is_faithful({"faithful": False})
    assert is_faithful({"faithful": None, "runs": []}) and not is_faithful({"faithful": None, "runs": [{"path": "r"}]})


def test_the_report_states_the_run_verdict_first():
    from testbed.measure.report import run_verdict

    ok = {"modes": {"basic": {"faithful": True}, "dualpath": {"faithful": True}}}
    bad = {"modes": {"basic": {"faithful": True}, "dualpath": {"faithful": False}}}
    assert run_verdict(ok).startswith("verdict: FAITHFUL in every mode")
    assert run_verdict(bad).startswith("verdict: UNFAITHFUL in dualpath") and "not a result" in run_verdict(bad)
