"""Detached lifecycle: `dualpath up --detach` returns with the testbed up, `status`/`exec`
see it, `down` leaves nothing, and a SIGKILLed runner's leftovers go with `down`."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from testbed.fabric import rundir
from testbed.api import Testbed
from testbed.fabric.cleanup import find_leftovers
from tests.conftest import dualpath, needs_root

pytestmark = needs_root


def _dead(pid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if rundir.proc_start(pid) is None:
            return True
        time.sleep(0.05)
    return False


def test_detached_services_status_exec_attach_down(no_leftovers):
    r = dualpath("up", "topologies/1p1d.yaml", "--detach", "--services", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)  # stdout is the JSON alone
    assert st["phase"] == "up" and st["owner"]["kind"] == "detached"
    assert set(st["timings"]) == {"fabric_s", "services_s"}
    assert {e["name"] for e in st["endpoints"]} >= {"dpt-p0e0", "dpt-d0e0", "dpt-s0"}
    assert set(st["agents"]) == {"dpt-p0", "dpt-d0", "dpt-p0e0", "dpt-p0e1", "dpt-d0e0", "dpt-d0e1"}
    assert st["store"]["endpoints"] == ["10.78.0.3:7000"]
    pids = [p["pid"] for p in st["processes"]]
    assert len(pids) == 7 and all(rundir.proc_start(p) for p in pids)

    s = dualpath("status")
    assert s.returncode == 0 and "1p1d: up, detached" in s.stdout and "agent dpt-d0e1" in s.stdout
    e = dualpath("exec", "d0e0", "--", "sh", "-c", 'echo "$DUALPATH_IFACE"; exit 5')
    assert e.returncode == 5 and e.stdout.strip() == "dpt-d0e0-cnic"

    with Testbed.attach() as tb:  # a view: leaving it closes only its store client
        key = os.urandom(16).hex()  # the store's key format: 32 lowercase hex digits
        block = os.urandom(tb.state["store"]["block_bytes"])
        assert tb.store.put(key, block)
        assert bytes(tb.store.get(key)) == block
        assert tb.agents["dpt-p0e0"] == "dpt-p0e0"
    assert dualpath("status").returncode == 0  # still up

    d = dualpath("down", timeout=120)
    assert d.returncode == 0 and "nothing left behind" in d.stdout, d.stdout + d.stderr
    assert all(_dead(p) for p in pids)
    assert find_leftovers().empty()
    assert dualpath("status").stdout.strip() == "nothing is up"


def test_sigkilled_runner_is_cleaned_by_down(no_leftovers):
    r = dualpath("up", "--detach", "--json")
    assert r.returncode == 0, r.stderr
    runner = json.loads(r.stdout)["owner"]["pid"]
    os.kill(runner, signal.SIGKILL)
    assert _dead(runner)
    s = dualpath("status")
    assert s.returncode == 1 and "owner is gone" in s.stdout
    again = dualpath("up", "--detach")
    assert again.returncode == 1 and "owner (pid" in again.stderr and "`dualpath down`" in again.stderr
    d = dualpath("down")
    assert d.returncode == 0 and "removed what it left" in d.stdout and "namespaces" in d.stdout, d.stdout
    assert find_leftovers().empty(), find_leftovers()


def test_a_fabric_only_bring_up_does_not_import_torch(no_leftovers):
    """torch takes about 2 s to import here, 4/5 of `up --detach`; a fabric without services never
    needs it (the bring-up target is <= 2 s to a usable fabric)."""
    import subprocess
    import sys

    from tests.conftest import REPO

    code = ("import sys\nfrom testbed import Testbed\nwith Testbed('1p1d') as tb:\n"
            "    print(sorted(m for m in ('torch', 'testbed.cluster.processes') if m in sys.modules))\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[]", p.stdout


def test_an_interrupted_up_says_it_tore_down(no_leftovers):
    """typer turns Ctrl-C into exit code 130 before our handler sees a KeyboardInterrupt; the
    one line that says the fabric is gone must still be printed."""
    import subprocess

    from tests.conftest import CLI, REPO

    p = subprocess.Popen([*CLI, "up", "topologies/1p1d.yaml", "--hold", "60"], cwd=REPO, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for line in p.stdout:  # up, or its end (EOF) if it failed
        if "Ctrl-C tears down" in line:
            break
    p.send_signal(signal.SIGINT)
    err = p.communicate(timeout=60)[1]
    assert p.returncode == 130 and "dualpath: interrupted; torn down" in err, err
    assert find_leftovers().empty()



def test_a_foreground_fabric_holds_the_run_directory_and_a_killed_one_goes_with_down(no_leftovers):
    """`dualpath run`, `check`, `bench` and `up --hold` bring a bare fabric up in the foreground;
    while it is up, `status` and `exec` see it and a second testbed is refused saying whose it is
    (they once saw nothing, and a second `up` blamed "leftovers of an earlier run")."""
    import subprocess

    from tests.conftest import CLI, REPO

    p = subprocess.Popen([*CLI, "up", "topologies/1p1d.yaml", "--hold", "60"], cwd=REPO, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for line in p.stdout:
            if "Ctrl-C tears down" in line:
                break
        st = json.loads(dualpath("status", "--json").stdout)
        assert st["status"] == "up" and st["owner"] == {**st["owner"], "kind": "up --hold", "pid": p.pid}, st
        assert "dpt-p0e0" in {e["name"] for e in st["endpoints"]}
        r = dualpath("exec", "p0e0", "--", "cat", "/proc/self/net/dev")
        assert r.returncode == 0 and "dpt-p0e0-cnic" in r.stdout, r.stderr
        again = dualpath("up", "--hold", "1")
        assert again.returncode == 1 and f"already up, owned by pid {p.pid}" in again.stderr, again.stderr
        d = dualpath("down")
        assert d.returncode == 1 and "--force" in d.stderr
        p.kill()  # SIGKILL: nothing unwinds, the recorded state says what `down` removes
        p.wait(timeout=10)
        d = dualpath("down")
        assert d.returncode == 0 and "removed what it left" in d.stdout and "namespaces" in d.stdout, d.stdout
        assert find_leftovers().empty(), find_leftovers()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


HOLDER = """
import faulthandler, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for a stack if it hangs
from testbed import Testbed
with Testbed("1p1d") as tb:
    print("up", flush=True)
    if sys.argv[1] == "raise":
        raise ValueError("the user's code failed")
    time.sleep(60)
"""


def test_a_python_holder_interrupted_terminated_failing_or_killed_leaves_nothing(no_leftovers):
    import subprocess
    import sys

    from tests.conftest import REPO

    def as_from_a_terminal() -> None:
        # A suite started in the background (`make test &`, a CI step's job) has SIGINT ignored,
        # and Python leaves an inherited SIG_IGN alone: the holder would sleep through its
        # Ctrl-C (the hang two stops reported as an xfail). A user's Ctrl-C reaches a process
        # whose SIGINT is the default, so the holder starts with that.
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    for ending in ("SIGINT", "SIGTERM", "raise", "SIGKILL"):
        p = subprocess.Popen([sys.executable, "-c", HOLDER, ending], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=as_from_a_terminal)
        assert p.stdout.readline() == "up\n", p.stderr.read()
        if ending != "raise":
            p.send_signal(getattr(signal, ending))
        try:
            err = p.communicate(timeout=60)[1]
        except subprocess.TimeoutExpired:  # a hung teardown: take its stack, end the holder and remove
            p.send_signal(signal.SIGUSR1)  # what it left, so that it blocks no later test; then fail
            time.sleep(1)
            p.kill()
            dualpath("down")
            pytest.fail(f"the holder did not unwind within 60 s of {ending}; its stack: {p.communicate()[1][-3000:]}")
        if ending == "SIGKILL":  # nothing unwinds: its state names what `down` removes
            assert not find_leftovers().empty()
            d = dualpath("down")
            assert d.returncode == 0 and "removed what it left" in d.stdout, d.stdout + d.stderr
        else:
            assert p.returncode != 0 and ("KeyboardInterrupt" in err or "ValueError" in err), err
        assert find_leftovers().empty(), (ending, find_leftovers())
