"""A team's connector through `dualpath run` on 1p1d-io: the working example passes every check in
the modes it runs in (its classes named by the engines), and the deliberately wrong one fails its
run with a report naming the request, the layer and the check."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tests.conftest import REPO, dualpath, needs_root


@pytest.fixture(autouse=True, scope="module")
def _own_the_machine():
    """This module's tests bring up a testbed: skip them while another run holds one."""
    from tests.conftest import own_the_machine
    own_the_machine()


pytestmark = needs_root
EXAMPLES = REPO / "examples" / "connectors"


def run(tmp_path, *args: str) -> tuple[object, dict]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{EXAMPLES}"}
    r = dualpath("run", "topologies/1p1d-io.yaml", "--out", str(tmp_path / "out"), *args, timeout=600, env=env)
    (folder,) = (tmp_path / "out").iterdir()
    return r, json.loads((folder / "summary.json").read_text())


def test_the_working_example_passes_every_check(tmp_path):
    r, s = run(tmp_path, "--modes", "basic,dualpath", "--trajectories", "6",
               "--connector", "simple_layerwise:SimpleConnectors")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "every check passed" in r.stdout and "FAILED" not in r.stdout
    assert s["connector"]["name"] == "simple-layerwise" and s["connector"]["modes"] == ["basic", "dualpath"]
    basic, dual = s["modes"]["basic"], s["modes"]["dualpath"]
    # basic keeps the built-in prefill connector; the decode side is the plug-in's in both
    assert basic["connectors"] == {"prefill": ["BasicConnector"], "decode": ["SimpleDecode"]}, basic["connectors"]
    assert dual["connectors"] == {"prefill": ["SimpleLayerwise"], "decode": ["SimpleDecode"]}, dual["connectors"]
    for m in (basic, dual):
        v = m["verification"]
        assert v["all_match"] and v["tokens_match"] == v["requests"] == 60 and m["errors"] == 0, v
        assert m["kv_bytes_vs_expected"]["within"] == m["kv_bytes_vs_expected"]["nics"]
    assert dual["paths"]["de"] > 0 and dual["paths"]["pe"] > 0  # both read paths ran through it
    assert dual["peak_hit_kv_layers_in_hbm"]["max"] <= 1.0  # no prefetch: one layer of past at a time


def test_the_wrong_example_fails_naming_request_layer_and_check(tmp_path):
    r, s = run(tmp_path, "--modes", "dualpath", "--trajectories", "2",
               "--connector", str(EXAMPLES / "wrong_layer.py") + ":WrongLayer")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    first = s["modes"]["dualpath"]["verification"]["first_failed_check"]
    assert first["check"] == "pe_kv_bit_exact" and first["layer"] == 1, first  # layer 0 is read right
    assert (f"check pe_kv_bit_exact failed at request {first['request']}, layer 1" in r.stdout), r.stdout[-3000:]
    assert s["modes"]["dualpath"]["connectors"]["prefill"] == ["OffByOneLayer"]


def test_the_working_example_on_mooncakes_transfer_engine(tmp_path):
    """The same plug-in on another transport: every engine and host agent moves KV through
    Mooncake's transfer engine (dualpath/transport/mooncake.py); both read paths bit-exact and the
    bytes per NIC, counted in the kv class only, within 2 % of the path definitions."""
    if importlib.util.find_spec("mooncake") is None:  # not imported here: the nodes import it
        pytest.skip("the Mooncake wheel is not installed")
    r, s = run(tmp_path, "--modes", "basic,dualpath", "--trajectories", "6", "--transport", "mooncake",
               "--connector", "simple_layerwise:SimpleConnectors")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "every check passed" in r.stdout
    assert s["transport"] == "mooncake/tcp", s["transport"]
    for m in s["modes"].values():
        v = m["verification"]
        assert v["all_match"] and v["tokens_match"] == v["requests"] == 60 and m["errors"] == 0, v
        assert m["kv_bytes_vs_expected"]["within"] == m["kv_bytes_vs_expected"]["nics"]
    dual = s["modes"]["dualpath"]
    assert dual["connectors"]["prefill"] == ["SimpleLayerwise"] and dual["paths"]["de"] > 0 and dual["paths"]["pe"] > 0
