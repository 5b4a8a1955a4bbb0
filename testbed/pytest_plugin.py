"""pytest plugin: a `dualpath_testbed` fixture that brings a topology up around your tests.

Installed with the package (entry point `pytest11`), so any test in a venv that has the
testbed installed can ask for it:

    import pytest

    pytestmark = pytest.mark.dualpath_topology("1p1d")   # or a path, services=True

    def test_mine(dualpath_testbed):
        tb = dualpath_testbed                             # a testbed.Testbed that is up
        tb.exec("p0e0", ["ip", "-br", "addr"], check=True)

Scope: `--dualpath-scope module` (the default; ini `dualpath_scope`) brings one testbed up per
module that uses it and tears it down after the module's last test; `session` keeps one for
the whole run. One machine holds one testbed at a time.

Which testbed: in module scope, the module's `dualpath_topology(topology, services=False)`
marker; otherwise (and in session scope) `--dualpath-topology` / `--dualpath-services`, else
the ini keys `dualpath_topology` / `dualpath_services`, else 1p1d without services.
`--dualpath-attach` uses the testbed that is already up (`dualpath up --detach` in an earlier
CI step) and leaves it up.

Not root: every test that uses the fixture is skipped, saying why; nothing errors. A pipeline
that must run them (and would otherwise pass green with nothing run, had it lost root) says
`--dualpath-require-root` (or DUALPATH_REQUIRE_ROOT=1, or the ini key `dualpath_require_root`):
then each such test fails, saying why.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

MARKER = "dualpath_topology"
REQUIRE_ROOT_ENV = "DUALPATH_REQUIRE_ROOT"


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("dualpath", "DualPath testbed (the dualpath_testbed fixture)")
    g.addoption("--dualpath-topology", default=None, metavar="TOPOLOGY",
                help="topology YAML or shipped name (1p1d, 2p1d, ...) for tests without a marker")
    g.addoption("--dualpath-services", action="store_true", default=None,
                help="also start the store, host agents and engines")
    g.addoption("--dualpath-scope", default=None, choices=("module", "session"),
                help="tear the testbed down after each module (default) or at the end of the session")
    g.addoption("--dualpath-attach", action="store_true", default=False,
                help="use the testbed that is already up (`dualpath up --detach`); never tear it down")
    g.addoption("--dualpath-require-root", action="store_true", default=False,
                help=f"fail, not skip, the tests that use the testbed when not root (also {REQUIRE_ROOT_ENV}=1)")
    parser.addini("dualpath_topology", "default topology of the dualpath_testbed fixture", default="1p1d")
    parser.addini("dualpath_services", "start services in the dualpath_testbed fixture", type="bool",
                  default=False)
    parser.addini("dualpath_scope", "module or session", default="module")
    parser.addini("dualpath_require_root", "fail, not skip, the testbed's tests when not root", type="bool",
                  default=False)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}(topology, services=False): the testbed the "
                            "dualpath_testbed fixture brings up for this module (module scope)")
    scope = _scope("dualpath_testbed", config)
    if scope not in ("module", "session"):  # here: a scope callable's own errors become internal errors
        raise pytest.UsageError(f"dualpath_scope = {scope!r}: choose module or session")


def _scope(fixture_name: str, config: pytest.Config) -> str:
    return config.getoption("dualpath_scope") or config.getini("dualpath_scope") or "module"


def _require_root(config: pytest.Config) -> bool:
    env = os.environ.get(REQUIRE_ROOT_ENV, "").strip().lower()
    return (bool(config.getoption("dualpath_require_root")) or env in ("1", "true", "yes")
            or bool(config.getini("dualpath_require_root")))


def _want(request: pytest.FixtureRequest) -> tuple[str, bool]:
    """(topology, services) for this fixture instance: the module's marker, else the options."""
    config = request.config
    opt_svc = config.getoption("dualpath_services")
    topo = config.getoption("dualpath_topology") or config.getini("dualpath_topology") or "1p1d"
    services = bool(opt_svc) if opt_svc is not None else bool(config.getini("dualpath_services"))
    m = request.node.get_closest_marker(MARKER)  # the module in module scope; none on the session
    if m is not None:
        if m.args:
            topo = str(m.args[0])
        services = bool(m.kwargs.get("services", services))
    p = Path(topo)
    if not p.is_absolute() and (config.rootpath / p).exists():  # a path relative to the rootdir
        topo = str(config.rootpath / p)
    return topo, services


@pytest.fixture(scope=_scope)
def dualpath_testbed(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A testbed.Testbed that is up (see the module's docstring for which, and for how long).
    Skipped, not failed, when not root; a bring-up that fails fails its tests with one line."""
    if os.geteuid() != 0:
        why = "dualpath_testbed needs root (network namespaces, tc qdiscs); run pytest with sudo"
        if _require_root(request.config):
            pytest.fail(f"{why} (root is required here: --dualpath-require-root or {REQUIRE_ROOT_ENV})",
                        pytrace=False)
        pytest.skip(why)
    from testbed.api import Testbed, TestbedError

    if request.config.getoption("dualpath_attach"):
        try:
            tb = Testbed.attach()
        except TestbedError as e:
            pytest.fail(f"--dualpath-attach: {e}", pytrace=False)
    else:
        topo, services = _want(request)
        try:
            tb = Testbed(topo, services=services)
            tb.up()
        except (TestbedError, ValueError) as e:  # ValueError: a bad topology file, in one line
            pytest.fail(f"dualpath_testbed: {e}", pytrace=False)
    try:
        yield tb
    finally:
        tb.down()  # an attached view closes only its own store client
