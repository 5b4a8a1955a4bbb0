"""The pytest plugin without root: which testbed the fixture asks for, and a skip (not an
error) for a user who is not root. (With root, tests/test_testbed_api.py uses the fixture.)"""
from __future__ import annotations

import pytest

from testbed.api import TestbedError
from testbed.fabric.access import find_endpoint, node_argv
from testbed.topology import TOPOLOGIES, resolve_topology

pytest_plugins = ["pytester"]

# The inner runs' conftest: the plugin by module name (a venv may predate its entry point), and
# a Testbed that only records what it was asked for.
CONFTEST = """
import os
import pytest
pytest_plugins = ["testbed.pytest_plugin"]
ASKED = []

class FakeTestbed:
    def __init__(self, topology, services=False):
        self.topology, self.services = str(topology), services
    def up(self):
        ASKED.append(("up", os.path.basename(self.topology), self.services))
        return self
    def down(self):
        ASKED.append(("down", os.path.basename(self.topology), self.services))

@pytest.fixture(autouse=True, scope="session")
def _fake(request):
    import testbed.api
    mp = pytest.MonkeyPatch()
    mp.setattr(testbed.api, "Testbed", FakeTestbed)
    if request.config.getoption("--as-user"):
        mp.setattr(os, "geteuid", lambda: 1000)
    yield
    mp.undo()
    with open("asked.txt", "w") as f:
        f.write(repr(ASKED))

def pytest_addoption(parser):
    parser.addoption("--as-user", action="store_true")
"""


def _run(pytester: pytest.Pytester, *args: str) -> tuple[pytest.RunResult, str]:
    pytester.makeconftest(CONFTEST)
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider", *args)
    asked = pytester.path / "asked.txt"
    return res, asked.read_text() if asked.exists() else ""


def test_not_root_skips_with_a_reason(pytester):
    pytester.makepyfile(test_a="def test_x(dualpath_testbed):\n    raise AssertionError('ran')\n")
    res, asked = _run(pytester, "--as-user", "-rs")
    res.assert_outcomes(skipped=1)
    res.stdout.fnmatch_lines(["*dualpath_testbed needs root*run pytest with sudo*"])
    assert asked == "[]"


@pytest.mark.parametrize("how", ["option", "env", "ini"])
def test_required_root_fails_instead_of_skipping(pytester, monkeypatch, how):
    """A pipeline that lost root must not pass green with nothing run."""
    pytester.makepyfile(test_a="def test_x(dualpath_testbed):\n    pass\n")
    args = ["--as-user"]
    if how == "option":
        args.append("--dualpath-require-root")
    elif how == "env":
        monkeypatch.setenv("DUALPATH_REQUIRE_ROOT", "1")
    else:
        pytester.makeini("[pytest]\ndualpath_require_root = true\n")
    res, asked = _run(pytester, *args)
    res.assert_outcomes(errors=1)  # the fixture fails: the test errors, it is not skipped
    res.stdout.fnmatch_lines(["*dualpath_testbed needs root*root is required here*"])
    assert asked == "[]"


def test_module_marker_option_and_scopes(pytester):
    pytester.makepyfile(
        test_a="import pytest\npytestmark = pytest.mark.dualpath_topology('2p1d', services=True)\n"
               "def test_1(dualpath_testbed): assert dualpath_testbed.services\n"
               "def test_2(dualpath_testbed): pass\n",
        test_b="def test_3(dualpath_testbed): assert dualpath_testbed.topology.endswith('1p2d')\n")
    res, asked = _run(pytester, "--dualpath-topology", "1p2d")
    res.assert_outcomes(passed=3)
    # module scope: one testbed per module, the marker beating the option, down after each module
    assert asked == ("[('up', '2p1d', True), ('down', '2p1d', True), "
                     "('up', '1p2d', False), ('down', '1p2d', False)]"), asked
    res, asked = _run(pytester, "--dualpath-scope", "session", "--dualpath-services")
    res.assert_outcomes(passed=2, failed=1)  # test_1 sees the session's testbed, not its module's marker
    assert asked == "[('up', '1p1d', True), ('down', '1p1d', True)]", asked


def test_bad_scope_is_a_usage_error(pytester):
    pytester.makepyfile(test_a="def test_x(dualpath_testbed): pass\n")
    pytester.makeini("[pytest]\ndualpath_scope = forever\n")
    res, _ = _run(pytester)
    assert res.ret != 0
    res.stderr.fnmatch_lines(["*dualpath_scope = 'forever': choose module or session*"])
    assert "Traceback" not in res.stderr.str() and "INTERNALERROR" not in res.stdout.str()


def test_topology_names_and_nodes():
    assert resolve_topology("2p1d") == TOPOLOGIES / "2p1d.yaml"
    assert resolve_topology(None) == TOPOLOGIES / "1p1d.yaml"
    assert str(resolve_topology("mine/x.yaml")) == "mine/x.yaml"
    state = {"endpoints": [{"name": "dpt-p0e0", "nics": [{"kind": "cnic", "dev": "dpt-p0e0-cnic", "ip": "10.77.0.2"}]}]}
    assert find_endpoint(state, "p0e0") is find_endpoint(state, "dpt-p0e0")
    assert node_argv(state, "p0e0", "echo hi") == ["ip", "netns", "exec", "dpt-p0e0", "/bin/sh", "-c", "echo hi"]
    with pytest.raises(TestbedError, match=r"^no node 'x9' in this testbed; nodes: p0e0$"):
        find_endpoint(state, "x9")
    with pytest.raises(TestbedError, match="empty command"):
        node_argv(state, "p0e0", [])
