"""table1 and table2: computed without the testbed, compared against the paper within the stated tolerance."""
import json

import pytest

from testbed.reproduce import reproduce_id
from testbed.reproduce import table1, table2
from tests.reproduce_helpers import HEADLINE_KEYS, is_valid_png


@pytest.fixture(scope="module")
def t1(tmp_path_factory):
    out, res = reproduce_id("table1", out_root=tmp_path_factory.mktemp("r"), command="test", run_id="x",
                            progress=lambda m: None)
    return out, json.loads((out / "summary.json").read_text())


def test_table1_summary_interface(t1):
    out, s = t1
    assert s["id"] == "table1" and s["faithful"] is None and s["is_result"] is True
    assert s["pngs"] == ["table1.png"] and is_valid_png(out / "table1.png")
    for h in s["headline"]:
        assert set(h) == HEADLINE_KEYS and h["bound"] is None and h["n"] is None and h["ci95"] is None
    assert {tuple(sorted(r)) for r in s["rows"]} == {("append_tokens", "context_tokens", "gb_per_pflop", "model", "paper")}
    assert {r["model"] for r in s["rows"]} == {"deepseek-v3", "deepseek-v3.2", "qwen2.5-32b", "ds-27b"}
    report = (out / "report.md").read_text()
    assert "Produced by `test`" in report and "| quantity | testbed | 95 % interval | n | paper | bound |" in report


@pytest.mark.parametrize("model", ["deepseek-v3.2", "qwen2.5-32b"])
def test_table1_within_ten_percent_of_the_paper(t1, model):
    _, s = t1
    rows = [r for r in s["rows"] if r["model"] == model and r["paper"] is not None]
    assert [r["context_tokens"] for r in rows] == [16384, 65536]
    for r in rows:
        assert r["gb_per_pflop"] == pytest.approx(r["paper"], rel=table1.TOLERANCE)


def test_table1_v32_on_the_trace_is_about_22(t1):
    _, s = t1
    h = next(h for h in s["headline"] if "32,721" in h["name"])
    assert h["paper"] == 22.0 and h["testbed"] == pytest.approx(22.0, rel=0.05)


def test_table1_reports_rows_outside_the_tolerance_as_they_are(t1):
    """DeepSeek-V3 at 64K is 11 % under the paper: reported, not hidden or tuned."""
    out, s = t1
    v3 = {c["context_tokens"]: c for c in s["checks"] if c["model"] == "deepseek-v3"}
    assert v3[16384]["within_tolerance"] and not v3[65536]["within_tolerance"]
    assert "OUTSIDE" in (out / "report.md").read_text()


@pytest.fixture(scope="module")
def t2(tmp_path_factory):
    out, res = reproduce_id("table2", quick=True, out_root=tmp_path_factory.mktemp("r"), command="test", run_id="x",
                            progress=lambda m: None)
    return out, json.loads((out / "summary.json").read_text())


def test_table2_summary_and_png(t2):
    out, s = t2
    assert s["id"] == "table2" and s["faithful"] is None and s["scale_factor"] == 32
    assert s["pngs"] == ["table2.png"] and is_valid_png(out / "table2.png")
    assert "divided by 32" in s["scale_down"] and "divided by 32" in (out / "report.md").read_text()
    assert [p["preset"] for p in s["presets"]] == ["32K", "48K", "64K"]
    for h in s["headline"]:
        assert set(h) == HEADLINE_KEYS


def test_table2_matches_the_paper_within_its_tolerances(t2):
    _, s = t2
    assert s["checks"] and all(c["within_tolerance"] for c in s["checks"]), [c for c in s["checks"] if not c["within_tolerance"]]
    stats = {c["stat"] for c in s["checks"] if c["preset"] == "64K"}
    assert stats == {"append_mean", "gen_mean", "context_mean", "total_len_mean", "hit_rate", "turns_drawn"}


def test_table2_statistics_are_the_generators_in_paper_units():
    """Lengths come back multiplied by the scale factor; turns drawn are the generator's own draws."""
    from dualpath.workload import generate, scaled, workload_stats

    st = table2.preset_stats("64K", factor=32, n=20)
    raw = workload_stats(generate(scaled("64K", 32, n_trajectories=20)).trajectories, block_size=2)
    assert st["append_mean"] == pytest.approx(raw["append_mean"] * 32)
    assert st["context_mean"] == pytest.approx(raw["prompt_len_mean"] * 32)
    assert st["turns_mean"] == raw["turns_mean"] <= st["turns_drawn"]
    assert st["hit_block_tokens"] == 2 and st["hit_rate"] == raw["hit_rate"]
