"""`dualpath run` refuses what it can before bringing anything up (duplicate modes, an --out that
cannot take the results, a truncated checkpoint), and keeps its scratch folder until the results
are written. Nothing here brings a topology up: the bring-up itself is replaced by a guard that
fails the test."""
from __future__ import annotations

import contextlib
import types
import json
import os
import shutil

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import typer

from testbed.cli import shared as cli_shared
from testbed.cli import run as cli
from tests.conftest import REPO

TOPO = REPO / "topologies" / "1p1d.yaml"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    from dualpath.model.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("ck") / "tiny", seed=0, kind="qwen2", num_hidden_layers=2)


@pytest.fixture(autouse=True)
def no_bring_up(monkeypatch):
    def guard(_topo):
        raise AssertionError("the test would have brought a topology up")

    monkeypatch.setattr(cli_shared, "_fabric", guard)
    monkeypatch.setattr("testbed.experiments.ablation.claimed_fabric", guard)
    monkeypatch.setattr(cli, "_testbed_fabric", guard)


def refused(capsys, *args, words: tuple[str, ...], fix: bool = True) -> str:
    with pytest.raises(typer.Exit) as e:
        cli._check_run_args(*args)
    assert e.value.exit_code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dualpath: ") and ("fix" in err[0] or not fix), err
    for w in words:
        assert w in err[0], err[0]
    return err[0]


def test_good_arguments_pass(ckpt, tmp_path):
    t, modes, path, geom = cli._check_run_args(TOPO, "basic, dualpath", ckpt, tmp_path / "out")
    assert modes == ("basic", "dualpath") and path == ckpt and geom.n_layer == 2 and t.name == "1p1d"
    assert list((tmp_path / "out").iterdir()) == []  # the write check leaves nothing behind


@pytest.mark.parametrize("modes, words", [
    ("basic,basic", ("--modes", "basic given more than once")),
    ("basic,dualpath, basic ,oracle,oracle", ("basic,oracle",)),
    ("basic,nope", ("--modes", "unknown mode(s) nope")),
    (",,,", ("--modes", "unknown mode(s)")),
    ("x" * 100_000, ("--modes",)),
])
def test_bad_modes(capsys, ckpt, tmp_path, modes, words):
    msg = refused(capsys, TOPO, modes, ckpt, tmp_path, words=words)
    assert len(msg) < 400


def test_an_out_that_cannot_take_the_results_is_refused_before_bring_up(capsys, ckpt, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    refused(capsys, TOPO, "basic", ckpt, blocker, words=("--out", str(blocker), "cannot write"))
    refused(capsys, TOPO, "basic", ckpt, blocker / "below", words=("--out",))
    refused(capsys, TOPO, "basic", ckpt, Path("/proc/dpt-results"), words=("--out",))


def test_a_truncated_checkpoint_is_refused_before_bring_up(capsys, ckpt, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    raw = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(raw[: len(raw) - 4096])
    refused(capsys, TOPO, "basic", bad, tmp_path / "out", words=("model.safetensors", "truncated"))
    d = json.loads((bad / "config.json").read_text())
    d["rms_norm_eps"] = "small"
    (bad / "config.json").write_text(json.dumps(d))
    refused(capsys, TOPO, "basic", bad, tmp_path / "out", words=("config.json", "'rms_norm_eps'"), fix=False)


def test_a_bad_topology_is_refused_first(capsys, ckpt, tmp_path):
    refused(capsys, Path("/dev/zero"), "basic", ckpt, tmp_path, words=("/dev/zero", "not a regular file"))


def test_results_are_written_before_the_scratch_folder_goes(monkeypatch, ckpt, tmp_path):
    from testbed.fabric import cleanup
    from testbed.experiments import ablation as experiment
    from testbed.measure import report

    seen: dict[str, Path] = {}

    @contextlib.contextmanager
    def fake_fabric(*_args):
        yield types.SimpleNamespace(timings={})

    def fake_run(fab, wl, checkpoint, scratch, **kw):
        scratch.mkdir(parents=True)
        (scratch / "engine.log").write_text("the logs of a run")
        seen["scratch"] = scratch
        return []

    def failing_write(results, summary, run_dir, command):
        assert seen["scratch"].exists(), "scratch deleted before the results were written"
        raise OSError(28, "No space left on device")

    # The fabric is faked, so what a real run on this host left behind is not this test's business.
    monkeypatch.setattr(cleanup, "find_leftovers", lambda *a, **k: cleanup.Leftovers())
    monkeypatch.setattr(cli_shared, "_fabric", fake_fabric)
    monkeypatch.setattr(experiment, "claimed_fabric", fake_fabric)  # no namespaces, no run directory
    monkeypatch.setattr(cli, "_testbed_fabric", fake_fabric)
    monkeypatch.setattr(experiment, "run_e2e", fake_run)
    monkeypatch.setattr(experiment, "summarize", lambda *a: {"modes": {}})
    monkeypatch.setattr(experiment, "write_results", failing_write)
    monkeypatch.setattr(report, "e2e_lines", lambda summary: ["ok"])
    with pytest.raises(OSError):
        cli._run_e2e(TOPO, "basic", 1, 0, ckpt, tmp_path / "out", "test")
    assert (seen["scratch"] / "engine.log").exists()  # a failed write keeps the run's logs
    shutil.rmtree(seen["scratch"])

    def good_write(results, summary, run_dir, command):
        assert seen["scratch"].exists()
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text("{}")

    monkeypatch.setattr(experiment, "write_results", good_write)
    with pytest.raises(typer.Exit) as e:
        cli._run_e2e(TOPO, "basic", 1, 0, ckpt, tmp_path / "out", "test")
    assert e.value.exit_code == 0
    assert not seen["scratch"].exists()  # written, then deleted
    assert list((tmp_path / "out").glob("*/report.md"))


GUARDED_CLI = (
    "import sys, testbed.cli as c\n"
    "def guard(_):\n"
    "    print('dualpath: TEST GUARD: would bring a topology up', file=sys.stderr); sys.exit(99)\n"
    "c._fabric = guard\n"
    "sys.argv = ['dualpath', *sys.argv[1:]]\n"
    "c.main()\n"
)


@pytest.mark.parametrize("args, words", [
    (["--modes", "basic,basic"], ["--modes", "more than once"]),
    (["--out", "/proc/dpt-results"], ["--out", "/proc/dpt-results"]),
    (["--modes", "warp"], ["--modes", "warp"]),
])
def test_the_cli_fails_in_one_line_before_bring_up(ckpt, args, words):
    """The real command line, in a child process, with the bring-up replaced by a guard."""
    if os.geteuid() != 0:
        pytest.skip("run checks root first")
    r = subprocess.run([sys.executable, "-c", GUARDED_CLI, "run", str(TOPO), "--checkpoint", str(ckpt), *args],
                       cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "TEST GUARD" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), r.stderr



@pytest.mark.parametrize("device, words", [
    ("tpu", ("--device", "'tpu' is not one of cpu, cuda")),
    pytest.param("cuda", ("--device", "sees no GPU here"), marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="this machine has a GPU: cuda is a good device here")),
])
def test_a_device_the_engines_cannot_compute_on_is_refused_before_bring_up(capsys, ckpt, tmp_path, device, words):
    refused(capsys, TOPO, "basic", ckpt, tmp_path, None, None, device, words=words)


@pytest.mark.parametrize("args, msg", [
    (["--verify", "most"], "expected all or sample:N"),
    (["--verify", "sample:2", "--fault", "snic-down@1"], "a fault run must check every request"),
])
def test_verify_option_is_checked_before_anything_runs(args, msg):
    from tests.conftest import dualpath

    p = dualpath("run", str(TOPO), *args, timeout=60)
    assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr
