"""Topology schema: every shipped file loads; bad files get a one-line error naming file, field, fix."""
from pathlib import Path

import pytest
import yaml

from testbed.topology import TopologyError, load_topology, parse_topology
from tests.conftest import REPO, dualpath

TOPOS = sorted((REPO / "topologies").glob("*.yaml"))
GOOD = yaml.safe_load((REPO / "topologies" / "1p1d.yaml").read_text())


def test_ships_required_topologies():
    names = {p.stem for p in TOPOS}
    assert {"1p1d", "2p1d", "1p2d", "2p4d"} <= names
    outside = [p for p in TOPOS if not load_topology(p).in_bottleneck_free_range()]
    assert outside, "at least one topology must lie outside the bottleneck-free P/D range"


@pytest.mark.parametrize("path", TOPOS, ids=lambda p: p.stem)
def test_shipped_topologies_load(path):
    t = load_topology(path)
    assert t.name == path.stem
    assert t.host_port_bps == min(t.g * t.cnic_bps, t.dram_bps)


def test_scaling_keeps_paper_units():
    t = parse_topology(GOOD)
    assert t.cnic_bps == 1_000_000_000  # 400 Gbit/s * 0.0025
    assert t.snic_bps == 250_000_000  # s*B
    lo, hi = t.pd_range()
    assert lo == pytest.approx(1 / 7) and hi == pytest.approx(3.5)


def _write(tmp_path: Path, doc: dict) -> Path:
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def _without(key: str) -> dict:
    d = dict(GOOD)
    del d[key]
    return d


@pytest.mark.parametrize("doc, field", [
    (_without("cnic_gbps"), "cnic_gbps"),  # missing
    ({**GOOD, "prefill_nodes": "two"}, "prefill_nodes"),  # wrong type
    ({**GOOD, "cnic_gbps": -400}, "cnic_gbps"),  # negative bandwidth
    ({**GOOD, "prefill_nodes": 0}, "prefill_nodes"),  # zero prefill nodes
    ({**GOOD, "engines_per_node": 0}, "engines_per_node"),  # g = 0
    ({**GOOD, "storage": {**GOOD["storage"], "disk_gbps": -1}}, "storage.disk_gbps"),
    ({**GOOD, "qos": "maybe"}, "qos"),
    ({**GOOD, "compute": "gpu"}, "compute"),
    ({**GOOD, "target": {"gpu": "a100", "model": "qwen2.5-32b"}}, "target"),
    ({**GOOD, "target": {"gpu": "h800", "model": "gpt-5"}}, "target"),
])
def test_bad_field_one_line_error(tmp_path, doc, field):
    path = _write(tmp_path, doc)
    with pytest.raises(TopologyError) as e:
        load_topology(path)
    msg = str(e.value)
    assert "\n" not in msg
    assert str(path) in msg and f"'{field}'" in msg and "fix:" in msg


def test_unknown_field_is_named(tmp_path):
    with pytest.raises(TopologyError, match="'cnic_gpbs' is not a topology field"):
        load_topology(_write(tmp_path, {**GOOD, "cnic_gpbs": 1}))


def test_not_yaml_and_missing_file(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("name: [unclosed\n")
    with pytest.raises(TopologyError, match="not valid YAML"):
        load_topology(p)
    with pytest.raises(TopologyError, match="cannot read"):
        load_topology(tmp_path / "nope.yaml")


def test_cli_bad_topology_is_one_line_no_traceback(tmp_path):
    path = _write(tmp_path, {**GOOD, "engines_per_node": 0})
    r = dualpath("topo", str(path))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "engines_per_node" in lines[0] and str(path) in lines[0]


def test_the_time_scale_follows_the_target_and_the_link_scale():
    t = parse_topology(GOOD)
    # Qwen2.5-32B keeps 256 KiB of KV per token; the demo model 2 KiB; links run at 1/400
    assert t.dilation(2048) == pytest.approx(2048 / 262144 * 400)
    assert t.dilation(4096) == pytest.approx(2 * t.dilation(2048))
    fast = parse_topology({**GOOD, "scale": 0.005})  # links twice as fast: time runs twice as fast
    assert fast.dilation(2048) == pytest.approx(t.dilation(2048) / 2)
    assert parse_topology({**GOOD, "compute": "cpu"}).dilation(2048) == 1.0
    line = next(x for x in t.describe(2048) if x.startswith("target "))
    assert "qwen2.5-32b on h800" in line and "dilation k = 3.12" in line


def test_topo_shows_each_engines_hbm_budget_and_the_largest_batch_per_mode():
    lines = parse_topology(GOOD).describe(2048)
    hbm = next(x for x in lines if x.startswith("HBM per engine"))
    # 80 GB less Qwen2.5-32B's 65.5 GB of BF16 weights less the 10 % reserve
    assert "prefill 80 GB less 65.5 GB of weights less a 8 GB reserve = 6.47 GB for KV; 24,689 tokens" in hbm
    batch = next(x for x in lines if x.startswith("largest prefill batch"))
    assert "Basic 24,588 tokens (12 requests)" in batch and "(379 requests)" in batch
    assert not any(x.startswith("HBM") for x in parse_topology({**GOOD, "compute": "cpu"}).describe(2048))


def test_topo_shows_a_length_scaled_budget_and_decodes_larger_group_apart():
    lines = parse_topology({**GOOD, "target": {"gpu": "h800", "model": "deepseek-v3.2", "hbm_length_scale": 32}}).describe(2048)
    hbm = next(x for x in lines if x.startswith("HBM per engine"))
    assert ("prefill (80 GB less 58.8 GB of weights less a 8 GB reserve) / 32 (hbm_length_scale) = 0.41 GB for KV; "
            "decode (80 GB less 38.4 GB of weights less a 8 GB reserve) / 32 (hbm_length_scale) = 1.05 GB") in hbm
    batch = next(x for x in lines if x.startswith("largest prefill batch"))
    assert "Basic 8,196 tokens (4 requests)" in batch


@pytest.mark.parametrize("bad", [0.5, 0, 2000, "x"])
def test_a_length_scale_below_1_or_past_1024_is_refused(bad):
    with pytest.raises(Exception, match="hbm_length_scale"):
        parse_topology({**GOOD, "target": {"gpu": "h800", "model": "qwen2.5-32b", "hbm_length_scale": bad}})


def test_cli_topo_prints_target_and_dilation():
    r = dualpath("topo", str(REPO / "topologies" / "1p1d.yaml"))
    assert r.returncode == 0, r.stderr
    assert "target qwen2.5-32b on h800" in r.stdout and "one emulated second lasts 3.12 s here" in r.stdout


@pytest.mark.parametrize("argv, words", [(("topo", "a", "b"), "unexpected extra argument"),
                                         (("run", "--trajectories", "0"), "--trajectories"),
                                         (("nope",), "No such command")])
def test_cli_usage_errors_are_one_line(argv, words):
    r = dualpath(*argv)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and lines[0].startswith("dualpath")
