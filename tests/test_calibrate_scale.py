"""`dualpath calibrate scale`'s search and recommendation (a stand-in verdict: no testbed)."""
import pytest

from testbed.reproduce.calibrate_scale import GROW, recommend, search_scale


def verdict_up_to(edge):
    calls = []

    def evaluate(scale):
        calls.append(scale)
        return scale <= edge
    return evaluate, calls


def test_grows_from_the_files_scale_then_bisects_to_the_tolerance():
    evaluate, calls = verdict_up_to(0.005)
    best, pts = search_scale(evaluate, 0.0016, max_probes=10, rel_tol=0.1)
    assert calls[:3] == [0.0016, 0.0016 * GROW, 0.0016 * GROW ** 2]  # 0.0064 is the first not faithful
    assert 0.005 * 0.9 <= best <= 0.005 and len(calls) <= 10
    rec = recommend(pts, margin=0.25)
    assert rec["bracketed"] and rec["faithful_up_to"] == best and rec["scale"] == pytest.approx(best / 1.25, rel=1e-4)
    assert rec["unfaithful_at"] > best


def test_shrinks_when_the_files_own_scale_is_not_faithful():
    evaluate, calls = verdict_up_to(0.0005)
    best, pts = search_scale(evaluate, 0.0016, max_probes=6, rel_tol=0.1)
    assert calls[:3] == [0.0016, 0.0016 / GROW, 0.0016 / GROW ** 2] and best is not None and best <= 0.0005


def test_probes_are_bounded_and_a_search_without_a_faithful_run_recommends_nothing():
    evaluate, calls = verdict_up_to(-1.0)
    best, pts = search_scale(evaluate, 0.0016, max_probes=3, rel_tol=0.1)
    assert len(calls) == 3 and best is None
    assert recommend(pts, 0.25) == {"faithful_up_to": None, "unfaithful_at": 0.0004, "margin": 0.25, "scale": None,
                                    "bracketed": False}
    evaluate, calls = verdict_up_to(1.0)  # every probe faithful: a lower bound, said so
    best, pts = search_scale(evaluate, 0.0016, max_probes=4, rel_tol=0.1)
    assert len(calls) == 4 and not recommend(pts, 0.25)["bracketed"]


def test_a_search_says_it_is_no_result_and_an_old_one_is_written_again_so(tmp_path):
    import json

    from tests.conftest import dualpath

    old = {"command": "dualpath calibrate scale x.yaml", "topology": "x.yaml", "file_scale": 0.0016,
           "file_dilation": 4.88, "modes": ["dualpath"], "agents": 24, "seed": 0,
           "probes": [{"scale": 0.0016, "dilation": 4.88, "faithful": True, "cpu_busy": {"dualpath": 0.4}, "wall_s": 30},
                      {"scale": 0.0032, "dilation": 2.44, "faithful": False, "cpu_busy": {"dualpath": 0.9}, "wall_s": 20}],
           "recommended": {"faithful_up_to": 0.0016, "unfaithful_at": 0.0032, "margin": 0.25, "scale": 0.00128,
                           "bracketed": True, "dilation": 6.1}}
    (tmp_path / "summary.json").write_text(json.dumps(old))
    p = dualpath("calibrate", "scale", "--report", str(tmp_path))
    assert p.returncode == 0, p.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["faithful"] is False and s["result"] is False and s["probes"] == old["probes"]
    assert (tmp_path / "report.md").read_text().count("NOT A RESULT") == 1 and "NOT A RESULT" in p.stdout
    p = dualpath("calibrate", "scale", "--report", str(tmp_path / "nowhere"))
    assert p.returncode == 2 and "no readable summary.json" in p.stderr and "Traceback" not in p.stderr
