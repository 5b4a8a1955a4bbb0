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
