"""Detached lifecycle: `dualpath up --detach`, `status`, `exec`, `down`.

`up --detach` forks a runner: a child process in its own session that owns the testbed (a
`Testbed` with owner kind "detached": the fabric's Mininet shells, and with services the
store servers, host agents and engines) and waits for SIGTERM. Forking, not starting a new
interpreter, keeps the imports already made: the fabric is usable about a second after the
command starts. The runner reports "ready" (or the one-line error that stopped it) over a
pipe, and the command returns; its output (the state: every namespace, NIC, address, store
endpoint and NIXL agent name) comes from the run directory's state.json.

`down` SIGTERMs the runner, recorded by pid and start time, and waits while it tears down.
A runner that is gone (SIGKILL, a crash) leaves its state behind: `down` then removes what the
state records itself. Nothing is ever found by a broad name.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable

from testbed.fabric import rundir

READY_TIMEOUT_S = {False: 60.0, True: 600.0}  # fabric only / with services (engines load a model)
REMOTE_READY_TIMEOUT_S = 600.0  # a fabric over several servers, or one server's part of it


class _Stop(Exception):
    pass


def start_detached(topology: Path, services: bool, checkpoint: Path | None = None,
                   transport: str = "tcp", server: str | None = None) -> dict[str, Any]:
    """Fork a runner that brings the testbed up (with `server`, only that server's part of a
    topology over several); return its state once it is up. Raises TestbedError (one line) if
    it could not come up; nothing is left behind then."""
    from testbed.api import Testbed, TestbedError

    tb = Testbed(topology, services=services, checkpoint=checkpoint, transport=transport, server=server)  # validates first
    tb.owner_kind = "detached"
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the runner: never returns into the caller's code
        os.close(r)
        code = 1
        try:
            code = _runner(tb, w)
        finally:
            os._exit(code)
    os.close(w)
    try:
        # over several servers, one may be a QEMU guest under TCG (make cluster-test): 5-9x slower
        from testbed.placement import spans_servers

        slow = server is not None or spans_servers(tb.topo)
        msg = _read_report(r, REMOTE_READY_TIMEOUT_S if slow else READY_TIMEOUT_S[services])
    except KeyboardInterrupt:  # the caller gave up: the runner must not stay up unseen
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
        raise
    finally:
        os.close(r)
    if msg.startswith("ready"):
        st = rundir.read()
        if st is None:
            raise TestbedError("the runner said ready but recorded no state")
        return st
    # It failed (and tore down what it made), hung or died: make sure nothing it made survives it.
    if msg.startswith("error timeout"):
        os.kill(pid, signal.SIGKILL)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    st = rundir.read()
    if st is not None and rundir.owner(st).pid == pid:
        from testbed.fabric.cleanup import remove_recorded

        remove_recorded(st)
    raise TestbedError(msg.removeprefix("error ").strip() or "the runner died while starting; "
                       "see `dualpath up` without --detach for its output")


def _read_report(fd: int, timeout_s: float) -> str:
    import select

    buf = b""
    deadline = time.monotonic() + timeout_s
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            return f"error timeout: the testbed was not up within {timeout_s:g}s"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                break  # the runner exited without a word
            buf += chunk
    return buf.decode(errors="replace").split("\n", 1)[0]


def _runner(tb, report_fd: int) -> int:
    """The runner's whole life: detach, bring up, report, wait for SIGTERM, tear down."""
    os.setsid()  # no terminal's Ctrl-C or hang-up reaches it; `down` does
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    # Keep no inherited descriptor: a caller's pipe would stay open (a CI step capturing the
    # output would wait for us), and a caller's lock (flock) would stay held until `down`.
    os.closerange(3, report_fd)
    os.closerange(report_fd + 1, 65536)
    stop = {"asked": False, "waiting": False}

    def on_signal(_signum: int, _frame: object) -> None:
        stop["asked"] = True
        if stop["waiting"]:
            raise _Stop  # out of the wait below; while starting, only noted (start finishes first)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        tb.claim()
    except Exception as e:
        _say(report_fd, f"error {e}")
        return 1
    log = os.open(tb.run_dir / "runner.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    try:
        tb.build()  # keeps our handlers (it only replaces a default SIGTERM)
    except BaseException as e:
        print(f"runner: bring-up failed: {e!r}", flush=True)
        _safe_down(tb)
        _say(report_fd, f"error {e}")
        return 1
    _say(report_fd, "ready")
    os.close(report_fd)
    print(f"runner: up ({tb.timings})", flush=True)
    try:
        stop["waiting"] = True
        if not stop["asked"]:
            while True:
                signal.pause()
    except _Stop:
        pass
    print("runner: stopping", flush=True)
    return 0 if _safe_down(tb) else 1


def _safe_down(tb) -> bool:
    try:
        tb.down()
        return True
    except BaseException as e:  # the state stays: `dualpath down` or `clean` finishes the job
        print(f"runner: teardown failed: {e!r}", flush=True)
        return False


def _say(fd: int, line: str) -> None:
    try:
        os.write(fd, (" ".join(line.split()) + "\n").encode())
    except OSError:
        pass  # the caller is gone; the state on disk still says what is up


# ---- the other commands ------------------------------------------------------------------------
def status() -> tuple[dict[str, Any] | None, str]:
    """(state, "up" | "starting" | "dead" | "down")."""
    st = rundir.read()
    if st is None:
        return None, ("starting" if rundir.RUN_DIR.exists() else "down")
    if not rundir.owner(st).alive():
        return st, "dead"
    return st, ("up" if st.get("phase") == "up" else "starting")


def down(force: bool = False, progress: Callable[[str], None] = print, timeout_s: float = 60.0) -> str:
    """Tear the testbed down; return one line saying what happened. Raises TestbedError when a
    live testbed is owned by a user's process (unless `force`)."""
    from testbed.api import TestbedError
    from testbed.fabric.cleanup import remove_recorded, stop_runner

    t0 = time.monotonic()
    st, what = status()
    if st is None:
        if what == "starting":  # a run directory with no state yet: its owner died at once, or is starting
            rundir.release()
            return "removed an empty run directory"
        return "nothing is up"
    ref = rundir.owner(st)
    kind = st.get("owner", {}).get("kind")
    if what in ("up", "starting") and kind == "detached":
        stop_runner(ref, timeout_s)
    elif what in ("up", "starting") and not force:
        raise TestbedError(rundir.describe_busy(st) + "; `dualpath down --force` removes it from under its owner")
    removed = remove_recorded(st)  # what a dead (or forced) owner left; nothing after a clean stop
    how = f"removed what it left: {', '.join(removed)}" if removed else "nothing left behind"
    return f"{st.get('topology', {}).get('name', '?')} down in {time.monotonic() - t0:.2f}s ({how})"


@dataclass(frozen=True)
class ExecOptions:
    """What `dualpath exec NODE [options] -- CMD` asks besides the command."""

    ucx: bool = False  # the kv class's UCX settings (as --class kv, without the group)
    traffic_class: str | None = None  # --class kv|model: every packet marked in it, its UCX settings
    python: bool = False  # --python: CMD is run by the testbed's own interpreter


def split_exec_args(args: list[str]) -> tuple[list[str], ExecOptions]:
    """(command, options) from what follows NODE on `dualpath exec NODE [--ucx] [--class C]
    [--python] -- CMD ...`.

    The command line parser stops at NODE (so that a command's own options stay its own) and
    hands over the rest verbatim, "--" included: options of ours may still sit between NODE and
    "--"; everything after the first "--" is the command, a later "--" included."""
    from testbed.api import TestbedError

    opts: dict[str, Any] = {}
    i = 0
    while i < len(args) and args[i] != "--" and args[i].startswith("-"):
        a = args[i]
        if a == "--ucx":
            opts["ucx"] = True
        elif a == "--python":
            opts["python"] = True
        elif a == "--class" or a.startswith("--class="):
            value = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
            i += 0 if "=" in a else 1
            if value not in ("kv", "model"):
                raise TestbedError(f"exec: --class {value[:40]!r}: choose kv or model")
            opts["traffic_class"] = value
        else:
            raise TestbedError(f"exec: no option {a!r} (options: --ucx, --class kv|model, --python); put the "
                               f"command after --: dualpath exec NODE -- CMD [ARGS...]")
        i += 1
    if args[i:i + 1] == ["--"]:
        i += 1
    return args[i:], ExecOptions(**opts)


def exec_argv(node: str, argv: list[str], opts: ExecOptions = ExecOptions()) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that run `argv` in a live testbed's node namespace."""
    from testbed.fabric.access import TestbedError, class_argv, enable_class_marking, find_endpoint, node_argv, node_env

    if not argv:
        raise TestbedError("exec: no command; usage: dualpath exec NODE -- CMD [ARGS...]")
    st, what = status()
    if what != "up":
        raise TestbedError({"down": "no testbed is up; start one with `dualpath up TOPOLOGY --detach`",
                            "starting": "the testbed is still starting; try again once `dualpath up` has returned",
                            "dead": rundir.describe_busy(st) if st else ""}[what])
    cmd = [sys.executable, *argv] if opts.python else argv
    if opts.traffic_class is not None:
        enable_class_marking(find_endpoint(st, node)["name"])
    return (class_argv(node_argv(st, node, cmd), opts.traffic_class),
            node_env(st, node, opts.ucx, traffic_class=opts.traffic_class))


def lines(st: dict[str, Any], what: str) -> list[str]:
    """The human-readable state: every namespace, NIC, address, store endpoint and agent."""
    o = st.get("owner", {})
    t = st.get("timings", {})
    times = ", ".join(f"{k.removesuffix('_s')} {v:.2f}s" for k, v in t.items())
    out = [f"{st['topology']['name']}: {what}, {o.get('kind', '?')} owner pid {o.get('pid')} since "
           f"{st.get('started_at', '?')}" + (f" (up in: {times})" if times else ""),
           f"  run dir {st.get('run_dir')}; bridges {', '.join(st.get('bridges', []))}; root namespace "
           + ", ".join(f"{k} {v}" for k, v in st.get("root_addresses", {}).items())]
    for e in st.get("endpoints", []):
        nics = ", ".join(f"{n['kind']} {n['dev']} {n['ip']} {n['rate_bps'] / 1e6:g} Mbit/s" for n in e["nics"])
        out.append(f"  {e['name']:<10} {e['kind']:<7} {nics}")
    store = st.get("store")
    if store:
        out.append(f"  store: {', '.join(store['endpoints'])} (Full Blocks of {store['block_bytes']} bytes)")
    for p in st.get("processes", []):
        alive = "up" if rundir.ProcRef.from_dict(p).alive() else "GONE"
        extra = f"agent {p['agent']} ({p.get('transport', '')}), control {p['control']}" if p.get("agent") \
            else f"listening {p.get('listen', '')}"
        out.append(f"  {p['name']:<10} {p['role']:<7} pid {p['pid']} {alive}: {extra}")
    if not st.get("services"):
        out.append("  no services (start them with --services)")
    return out
