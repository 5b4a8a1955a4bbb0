"""The run directory and the detached commands' pure parts, without root: one claim per
machine, a clear line saying who holds it, processes known by pid and start time, and how
`dualpath exec NODE ... -- CMD` splits what follows NODE."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from testbed import detach

from testbed.fabric import rundir
from testbed.api import TestbedError


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    d = tmp_path / "dpt-testbed"
    monkeypatch.setattr(rundir, "RUN_DIR", d)
    return d


def test_claim_is_one_per_machine_and_says_who_holds_it(run_dir):
    assert rundir.live_owner() is None
    st = rundir.claim("api", "1p1d")
    assert rundir.read() == st and st["owner"]["pid"] == os.getpid() and st["phase"] == "starting"
    assert rundir.live_owner() == rundir.owner(st)  # a live run: the suite's start must leave it up
    with pytest.raises(rundir.RunDirBusy, match=rf"^a testbed of 1p1d is already up, owned by pid {os.getpid()} "):
        rundir.claim("api", "2p1d")
    st["owner"]["kind"] = "detached"
    rundir.write(st)
    assert os.listdir(run_dir) == ["state.json"]  # the atomic write's temporary file is gone
    with pytest.raises(rundir.RunDirBusy, match=r"already up \(detached, runner pid .*`dualpath down` stops it$"):
        rundir.claim("detached", "1p1d")
    rundir.release()
    assert not run_dir.exists()
    assert rundir.claim("detached", "2p1d")["topology"] == {"name": "2p1d"}


def test_a_dead_owner_and_an_empty_dir_point_at_down(run_dir):
    p = subprocess.Popen(["sleep", "30"])
    ref = rundir.ProcRef.of(p.pid)
    p.kill()
    p.wait()
    assert ref is not None and not ref.alive() and rundir.ProcRef.of(p.pid) is None
    st = rundir.claim("detached", "1p1d")
    st["owner"].update(ref.to_dict())
    rundir.write(st)
    assert detach.status() == (st, "dead")
    assert rundir.live_owner() is None  # a dead owner's testbed is a leftover: the suite may sweep it
    with pytest.raises(rundir.RunDirBusy, match=rf"its owner \(pid {p.pid}\) is gone; run `dualpath down`"):
        rundir.claim("api", "1p1d")
    (run_dir / "state.json").unlink()
    assert detach.status() == (None, "starting")
    with pytest.raises(rundir.RunDirBusy, match="records no testbed"):
        rundir.claim("api", "1p1d")


def test_a_dir_from_an_earlier_boot_is_claimed_again(run_dir):
    st = rundir.claim("api", "1p1d")
    st["boot_id"] = "not-this-boot"
    rundir.write(st)
    assert rundir.claim("api", "2p1d")["boot_id"] == rundir.boot_id()


def test_a_reused_pid_is_not_the_recorded_process():
    me = rundir.ProcRef.of(os.getpid())
    assert me is not None and me.alive()
    assert not rundir.ProcRef(me.pid, me.start + 1).alive()
    assert rundir.ProcRef.from_dict(me.to_dict()) == me


def test_status_and_exec_without_a_testbed(run_dir):
    assert detach.status() == (None, "down")
    with pytest.raises(TestbedError, match="no testbed is up; start one with `dualpath up TOPOLOGY --detach`"):
        detach.exec_argv("p0e0", ["true"])
    st = rundir.claim("api", "1p1d")
    assert detach.status() == (st, "starting")
    st.update(phase="up", endpoints=[{"name": "dpt-p0e0", "nics": [{"kind": "cnic", "dev": "dpt-p0e0-cnic",
                                                                    "ip": "10.77.0.2"}]}])
    rundir.write(st)
    assert detach.status()[1] == "up"
    argv, env = detach.exec_argv("p0e0", ["ip", "-br", "addr"])
    assert argv == ["ip", "netns", "exec", "dpt-p0e0", "ip", "-br", "addr"]
    assert env["DUALPATH_IFACE"] == "dpt-p0e0-cnic" and env["DUALPATH_IP"] == "10.77.0.2"
    with pytest.raises(TestbedError, match="exec: no command; usage: dualpath exec NODE -- CMD"):
        detach.exec_argv("p0e0", [])


X = detach.ExecOptions


@pytest.mark.parametrize("args, want", [
    (["--", "sh", "-c", "echo --x"], (["sh", "-c", "echo --x"], X())),
    (["ls", "-la"], (["ls", "-la"], X())),  # no "--": the command as given
    (["--ucx", "--", "ls"], (["ls"], X(ucx=True))),  # our option between NODE and "--"
    (["--ucx", "ls", "--", "x"], (["ls", "--", "x"], X(ucx=True))),
    (["--", "--ucx"], (["--ucx"], X())),  # after "--" everything is the command's
    (["--", "a", "--", "b"], (["a", "--", "b"], X())),
    (["--"], ([], X())),
    ([], ([], X())),
    (["--class", "model", "--python", "--", "t.py"], (["t.py"], X(traffic_class="model", python=True))),
    (["--class=kv", "--", "iperf3"], (["iperf3"], X(traffic_class="kv"))),
])
def test_exec_args_after_the_node(args, want):
    assert detach.split_exec_args(args) == want


@pytest.mark.parametrize("args", [["--class", "gold", "--", "ls"], ["--class"], ["--class=", "ls"]])
def test_an_unknown_class_is_one_line(args):
    with pytest.raises(TestbedError, match=r"^exec: --class '.*': choose kv or model$"):
        detach.split_exec_args(args)


def test_an_unknown_option_before_the_command_is_one_line():
    with pytest.raises(TestbedError, match=r"^exec: no option '--ucxx' \(options: --ucx, --class kv\|model, --python\); put the command after --"):
        detach.split_exec_args(["--ucxx", "--", "ls"])


def test_a_run_in_progress_has_a_live_owner_and_a_killed_one_has_none(run_dir):
    """The suite's start sweeps a killed run's leftovers but must leave a live run alone (it once
    tore down a reproduce that was running beside it). A bare Fabric (as tests use one) claims no
    run directory: its Mininet shells' parent is what says it is alive."""
    from testbed.fabric.cleanup import MININET_TAG, live_owners

    owner = subprocess.Popen(["bash", "-c", f"exec -a '{MININET_TAG}ztest' sleep 30 & echo $!; wait"],
                             stdout=subprocess.PIPE, text=True)
    shell = 0
    try:
        shell = int(owner.stdout.readline())
        for _ in range(100):  # until the shell's exec has taken its tagged name
            if MININET_TAG in Path(f"/proc/{shell}/cmdline").read_bytes().decode(errors="replace"):
                break
            time.sleep(0.02)
        assert owner.pid in live_owners()
        owner.kill()
        owner.wait()
        for _ in range(100):
            ppid = rundir.parent_pid(shell)
            if ppid != owner.pid:
                break
            time.sleep(0.02)
        if ppid != 1:
            pytest.skip(f"a subreaper (pid {ppid}) adopted the orphan, so it looks owned")
        assert owner.pid not in live_owners()
    finally:
        owner.kill()
        if shell:
            try:
                os.kill(shell, signal.SIGKILL)
            except ProcessLookupError:
                pass
