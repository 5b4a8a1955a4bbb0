"""examples/ci/ runs as a user's project would run it: its own pytest, the plugin from the
package's entry point where the venv has it (a venv installed before it existed gets -p)."""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys

from tests.conftest import REPO, needs_root

pytestmark = needs_root


def test_example_runs_as_a_users_project_would():
    eps = {e.name for e in importlib.metadata.entry_points(group="pytest11")}
    plugin = [] if "testbed.pytest_plugin" in eps else ["-p", "testbed.pytest_plugin"]
    # as the shipped workflow runs it: a job that lost root must fail, not pass with nothing run
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin,
                        "--dualpath-require-root", "examples/ci"],
                       cwd=REPO, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "1 passed" in r.stdout
    workflow = (REPO / "examples" / "ci" / "github-actions.yml").read_text()
    assert "pytest -q --dualpath-require-root examples/ci" in workflow
