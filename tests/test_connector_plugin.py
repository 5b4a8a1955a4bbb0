"""A team's connector plug-in: loaded and checked against the contract before anything starts (one
line per problem), its KV hashed and shape-checked by the engine rather than trusted, the failed
checks named in the run's report. No root: the e2e half is tests/test_connector_e2e.py."""
from __future__ import annotations

import hashlib
import textwrap
from pathlib import Path

import pytest
import torch
import typer

from dualpath.kv.check import layer_hash
from dualpath.kv.connector import KVConnector, LayerwiseConnector, LoadPlan
from dualpath.kv.decode_connector import BufferDecodeConnector, DecodePlan
from dualpath.kv.layouts import BlockGeometry, pack_rows, unpack_layer
from dualpath.kv.plugin import (
    CONTRACT_VERSION, CheckedDecode, CheckedPrefill, ConnectorError, ConnectorPlugin, check_plugin, connector_name,
    load_plugin, parse_spec, resolve,
)
from testbed.cli import run as cli
from testbed.measure.report import failed_checks
from testbed.topology import TopologyError, load_topology
from tests.conftest import REPO

EXAMPLES = REPO / "examples" / "connectors"


def plugin_file(tmp_path: Path, body: str, name: str = "") -> Path:
    """A plug-in module under a name of its own (an imported name stays imported in this process)."""
    p = tmp_path / (name or f"team_{''.join(c if c.isalnum() else '_' for c in tmp_path.name)}.py")
    p.write_text("from dualpath.kv.plugin import ConnectorPlugin\n"
                 "from dualpath.kv.connector import LayerwiseConnector\n" + textwrap.dedent(body))
    return p


@pytest.mark.parametrize("body, words", [
    ("class P(ConnectorPlugin):\n    prefill = LayerwiseConnector\n    contract_version = 99\n",
     ["contract version 99", f"version {CONTRACT_VERSION}"]),
    ("class P(ConnectorPlugin):\n    pass\n", ["neither `prefill` nor `decode`"]),
    ("class P(ConnectorPlugin):\n    prefill = int\n", ["`prefill` must be a subclass", "KVConnector"]),
    ("from dualpath.kv.connector import KVConnector\nclass Half(KVConnector):\n"
     "    def start_load(self, plan): pass\nclass P(ConnectorPlugin):\n    prefill = Half\n",
     ["Half", "does not implement", "save_layer", "wait_for_layer", "wait_for_save"]),
    ("class P:\n    prefill = LayerwiseConnector\n", ["not a subclass of dualpath.kv.plugin.ConnectorPlugin"]),
    ("raise RuntimeError('boom\\nsecond line')\n", ["importing team_", "failed", "RuntimeError: boom second line"]),
    ("class Q(ConnectorPlugin):\n    prefill = LayerwiseConnector\n", ["has no 'P'"]),
])
def test_a_plugin_that_breaks_the_contract_is_refused_in_one_line(tmp_path, body, words):
    f = plugin_file(tmp_path, body)
    with pytest.raises(ConnectorError) as e:
        resolve(f"{f}:P")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("connector "), msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("spec, words", [
    ("nocolon", ["expected MODULE:CLASS"]),
    ("a:b:c", ["expected MODULE:CLASS"]),
    ("mod:not-a-name", ["not a Python class name"]),
    ("bad-module:P", ["not a module name"]),
    ("no_such_team_module_x:P", ["'no_such_team_module_x' not found", "PYTHONPATH"]),
    ("missing.py:P", ["no file"]),
])
def test_a_bad_spec_is_refused_in_one_line(tmp_path, spec, words):
    with pytest.raises(ConnectorError) as e:
        resolve(spec, tmp_path)
    for w in words:
        assert w in str(e.value), e.value


def test_the_examples_load_and_the_engines_import_root_is_found(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # a FILE is taken relative to base (a topology's folder), not the cwd
    ref, plugin = resolve("simple_layerwise.py:SimpleConnectors", EXAMPLES)
    assert (ref.module, ref.cls, ref.path) == ("simple_layerwise", "SimpleConnectors", EXAMPLES)
    assert ref.engine_args() == ["--connector", "simple_layerwise:SimpleConnectors", "--connector-path", str(EXAMPLES)]
    assert plugin.prefill.__name__ == "SimpleLayerwise" and plugin.decode.__name__ == "SimpleDecode"
    monkeypatch.syspath_prepend(str(tmp_path))
    pkg = tmp_path / "teampkg" / "kv"
    pkg.mkdir(parents=True)
    (tmp_path / "teampkg" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    plugin_file(pkg, "class P(ConnectorPlugin):\n    prefill = LayerwiseConnector\n", "conn.py")
    ref, _ = resolve("teampkg.kv.conn:P")
    assert ref.path == tmp_path  # a dotted module: the folder that holds its top package
    assert load_plugin(ref.module, ref.cls, ref.path).__name__ == "P"  # as an engine loads it
    with pytest.raises(ConnectorError, match="the name 'teampkg.kv.conn' is taken by"):
        load_plugin(ref.module, ref.cls, EXAMPLES)  # an engine told another folder than the module's
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "y.py").write_text("")
    assert parse_spec("x/y.py:C", tmp_path) == ("y", "C", tmp_path / "x")


# ---- the engine's side: what a plug-in hands the model is checked and hashed there ----------
def geometry() -> BlockGeometry:
    return BlockGeometry(n_layer=2, block_size=4, n_kv_heads=2, head_dim=8, dtype=torch.float32)


class Scripted(KVConnector):
    """Returns whatever the test gives it, and claims hashes of its own (which must be ignored)."""

    def __init__(self, geom, out):
        self.geom, self.out = geom, out
        from dualpath.kv.connector import ConnectorStats

        self.stats = ConnectorStats(layer_hashes=["forged"] * 2)

    def start_load(self, plan): pass
    def wait_for_layer(self, layer): return self.out(layer)
    def save_layer(self, layer, k, v): pass
    def wait_for_save(self): pass


def plan(n_past: int) -> LoadPlan:
    from dualpath.kv.connector import PastRead
    from dualpath.kv.spans import Span

    return LoadPlan("req-7", n_past, 3, (PastRead(Span("p", "buf", 0), 0, n_past),) if n_past else (), None)


def kv(g: BlockGeometry, n: int, dtype=None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (n, g.n_kv_heads, g.head_dim)
    return (torch.randn(shape, generator=gen).to(dtype or g.dtype), torch.randn(shape, generator=gen).to(dtype or g.dtype))


def test_the_engine_hashes_what_the_plugin_returns_not_what_it_claims():
    g = geometry()
    layers = [kv(g, 5, seed=s) for s in range(2)]
    c = CheckedPrefill(Scripted(g, lambda layer: layers[layer]), g)
    c.start_load(plan(5))
    for layer in range(2):
        c.wait_for_layer(layer)
    assert c.stats.layer_hashes == [layer_hash(k, v, g) for k, v in layers]
    # the same hash the built-in connectors take of the rows in HBM, and the verification of its own KV
    rows = torch.empty((5, g.bytes_per_token_per_layer), dtype=torch.uint8)
    pack_rows(*layers[1], g, rows)
    assert layer_hash(*unpack_layer(rows, g), g) == hashlib.blake2b(rows.numpy().tobytes(), digest_size=16).hexdigest()
    assert connector_name(c) == "Scripted"


@pytest.mark.parametrize("n_past, out, words", [
    (5, lambda g: kv(g, 4), ["req-7 layer 0", "(4, 2, 8)", "(5, 2, 8)"]),
    (5, lambda g: kv(g, 5, torch.float64), ["float64"]),
    (5, lambda g: [1, 2], ["not a (K, V) pair"]),
    (0, lambda g: kv(g, 0), ["no past", "None"]),
])
def test_a_plugin_returning_the_wrong_kv_fails_naming_request_and_layer(n_past, out, words):
    g = geometry()
    c = CheckedPrefill(Scripted(g, lambda layer: out(g)), g)
    c.start_load(plan(n_past))
    with pytest.raises(ConnectorError) as e:
        c.wait_for_layer(0)
    for w in words:
        assert w in str(e.value), e.value


def test_a_decode_plugin_returning_too_few_layers_is_caught():
    g = geometry()

    class Short(BufferDecodeConnector):
        def start_load(self, plan): self.plan = plan
        def poll_load(self): return [kv(g, 6)]

    c = CheckedDecode(Short(None, None, None, g), g)
    c.start_load(DecodePlan("req-9", 6, 2, 0, None, None))
    with pytest.raises(ConnectorError, match="req-9.*not a list of 2 layers"):
        c.poll_load()


def test_the_built_in_connectors_satisfy_the_contract():
    class Builtins(ConnectorPlugin):
        prefill = LayerwiseConnector
        decode = BufferDecodeConnector

    check_plugin(Builtins, "builtins")


# ---- front doors ----------------------------------------------------------------------------
def test_the_topology_names_a_connector_relative_to_its_folder(tmp_path, capsys):
    text = (REPO / "topologies" / "1p1d-io.yaml").read_text()
    (tmp_path / "t.yaml").write_text(text + "\nconnector: conns/mine.py:P\n")
    (tmp_path / "conns").mkdir()
    plugin_file(tmp_path / "conns", "class P(ConnectorPlugin):\n    prefill = LayerwiseConnector\n", "mine.py")
    t = load_topology(tmp_path / "t.yaml")
    ref, info = cli._connector(None, t, tmp_path / "t.yaml", ("basic", "dualpath", "oracle"))
    assert ref.path == tmp_path / "conns" and info["modes"] == ["dualpath"]
    assert "connector: conns/mine.py:P (contract v1; prefill LayerwiseConnector, decode built-in)" in capsys.readouterr().out
    with pytest.raises(typer.Exit) as e:  # no mode runs a prefill-only plug-in
        cli._connector(None, t, tmp_path / "t.yaml", ("basic", "oracle"))
    assert e.value.exit_code == 2 and "fix: add --modes dualpath" in capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text(text + "\nconnector: 'no colon here'\n")
    with pytest.raises(TopologyError, match="connector"):
        load_topology(tmp_path / "bad.yaml")


def summary(**mode) -> dict:
    m = {"errors": 0, "verification": {"all_match": True},
         "kv_bytes_vs_expected": {"nics": 2, "per_nic": [{"nic": "a/cnic", "expected": 10e6, "measured": 10e6, "ok": True},
                                                           {"nic": "b/cnic", "expected": 10e6, "measured": 10e6, "ok": True}]}}
    m.update(mode)
    return {"modes": {"dualpath": m}}


def test_the_report_names_each_failed_check():
    assert failed_checks(summary()) == []
    bad = failed_checks(summary(verification={"all_match": False, "first_mismatch": "dualpath-t0-r0",
                                              "first_failed_check": {"request": "dualpath-t0-r0",
                                                                     "check": "pe_kv_bit_exact", "layer": 1}}))
    assert bad == ["dualpath: check pe_kv_bit_exact failed at request dualpath-t0-r0, layer 1: the past KV the PE "
                   "loaded differs from the recomputation's"]
    nics = summary()["modes"]["dualpath"]["kv_bytes_vs_expected"]
    nics["per_nic"][1].update(measured=0.1e6, ok=False)  # its KV went in the model class
    (line,) = failed_checks(summary(kv_bytes_vs_expected=nics))
    assert "kv_bytes_vs_expected failed on 1 of 2 NICs" in line and "b/cnic" in line and "another class" in line
    (line,) = failed_checks(summary(errors=3, first_error={"request": "r1", "error": "TimeoutError: x"}))
    assert "3 request(s) failed" in line and "r1: TimeoutError: x" in line
