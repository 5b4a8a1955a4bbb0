"""Both Mooncake parts in one `dualpath run` on 1p1d-io-mooncake: Mooncake Store on the storage
host (mooncake_master and a DRAM segment) and its transfer engine as the KV transport. Both read
paths bit-exact, every NIC's bytes (the SNICs and the storage NIC included) within 2 % of the path
definitions, and nothing of Mooncake's left running. Faults on it are refused in one line."""
from __future__ import annotations

import importlib.util
import json

import psutil
import pytest

from tests.conftest import dualpath, needs_root


@pytest.fixture(autouse=True, scope="module")
def _own_the_machine():
    """This module's tests bring up a testbed: skip them while another run holds one."""
    from tests.conftest import own_the_machine
    own_the_machine()


pytestmark = [needs_root, pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                                             reason="the Mooncake wheel is not installed")]


def _mooncake_processes() -> list[str]:
    return [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])
            if any("mooncake_master" in a or "emulators.mooncake_store" in a for a in (p.info["cmdline"] or []))]


def test_store_and_transport_on_mooncake(tmp_path):
    r = dualpath("run", "topologies/1p1d-io-mooncake.yaml", "--modes", "basic,dualpath", "--trajectories", "6",
                 "--transport", "mooncake", "--out", str(tmp_path), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (folder,) = tmp_path.iterdir()
    s = json.loads((folder / "summary.json").read_text())
    assert s["transport"] == "mooncake/tcp" and "every check passed" in r.stdout
    for mode, m in s["modes"].items():
        v = m["verification"]
        assert v["all_match"] and v["tokens_match"] == v["requests"] == 60 and m["errors"] == 0, (mode, v)
        assert m["kv_bytes_vs_expected"]["within"] == m["kv_bytes_vs_expected"]["nics"], (mode, m["kv_bytes_vs_expected"])
    assert s["modes"]["dualpath"]["paths"]["de"] > 0 and s["modes"]["dualpath"]["paths"]["pe"] > 0
    assert _mooncake_processes() == []


def test_what_mooncake_cannot_do_is_refused_in_one_line(tmp_path):
    r = dualpath("run", "topologies/1p1d-io-mooncake.yaml", "--transport", "mooncake-rdma", "--out", str(tmp_path),
                 timeout=60)
    assert r.returncode == 2 and "reads them once per process" in r.stderr + r.stdout and "Traceback" not in r.stderr
    assert not any(tmp_path.iterdir())


def test_faults_are_refused_on_mooncake_store(tmp_path):
    r = dualpath("run", "topologies/1p1d-io-mooncake.yaml", "--fault", "store-crash@1", "--out", str(tmp_path),
                 timeout=60)
    assert r.returncode == 2 and "3FS-like store" in r.stderr + r.stdout and "Traceback" not in r.stderr
    assert not any(tmp_path.iterdir())
