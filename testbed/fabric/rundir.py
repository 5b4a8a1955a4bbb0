"""The one run directory of a live testbed: who owns it, and everything it brought up.

Every name the testbed creates is fixed by the topology (dpt-p0e0, dpt-cbr, ...), so one
machine can hold one testbed at a time. Its state lives in one directory, `RUN_DIR`:
creating it (an atomic mkdir) is the claim, made by every bring-up (a Testbed, the detached
runner, and the foreground fabric of `dualpath run`, `check`, `bench` and the reproduce and
isolation runs: testbed.fabric.access.claimed_fabric), so a second one fails with a clear error
instead of building over the first; `state.json` inside records the owner process and
every namespace, NIC, address, store endpoint, transport agent and process, so that
`dualpath status`, `exec` and `down` work from any shell, and `down` can remove exactly
what was made even after the owner was SIGKILLed.

Processes are recorded as (pid, start time in clock ticks since boot): a pid alone could
have been reused by an unrelated process by the time anyone acts on it.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dualpath.naming import PREFIX

# On disk, not tmpfs: the store of a testbed with services writes its blocks here.
RUN_DIR = Path("/var/tmp") / f"{PREFIX}-testbed"
STATE_FILE = "state.json"
STATE_VERSION = 1


class RunDirBusy(RuntimeError):
    """A testbed is already up (or its run directory was left by one that died)."""


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (state first); None if the process is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the command name may contain spaces and ')'
    return None if fields[0] in ("Z", "X") else fields


def proc_start(pid: int) -> int | None:
    """The start time of a live process in clock ticks since boot; None if gone or a zombie."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[19])


def parent_pid(pid: int) -> int | None:
    """The parent of a live process; None if gone or a zombie."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[1])


@dataclass(frozen=True)
class ProcRef:
    """A process as recorded: still the same process only while pid and start time match."""

    pid: int
    start: int

    @classmethod
    def of(cls, pid: int) -> "ProcRef | None":
        st = proc_start(pid)
        return None if st is None else cls(pid, st)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ProcRef":
        return cls(int(d["pid"]), int(d["start"]))

    def alive(self) -> bool:
        return proc_start(self.pid) == self.start

    def to_dict(self) -> dict[str, int]:
        return {"pid": self.pid, "start": self.start}


def claim(owner_kind: str, topology: str, run_dir: Path | None = None) -> dict[str, Any]:
    """Create the run directory for this process, or raise RunDirBusy saying who holds it.

    A directory left by an earlier boot can hold nothing live (namespaces and processes die
    with the machine), so it is removed and claimed again.
    """
    run_dir = run_dir or RUN_DIR  # looked up per call: a test points it elsewhere
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            os.mkdir(run_dir, 0o755)
            break
        except FileExistsError:
            st = read(run_dir)
            if st is not None and st.get("boot_id") and st["boot_id"] != boot_id():
                shutil.rmtree(run_dir, ignore_errors=True)
                continue
            raise RunDirBusy(describe_busy(st, run_dir)) from None
    else:
        raise RunDirBusy(describe_busy(read(run_dir), run_dir))
    me = ProcRef.of(os.getpid())
    assert me is not None
    state: dict[str, Any] = {
        "version": STATE_VERSION, "phase": "starting", "run_dir": str(run_dir), "boot_id": boot_id(),
        "owner": {"kind": owner_kind, **me.to_dict(), "cmdline": _cmdline(os.getpid())},
        "topology": {"name": topology}, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write(state, run_dir)
    return state


def describe_busy(state: dict[str, Any] | None, run_dir: Path | None = None) -> str:
    """One line: what holds the run directory, and what to do about it."""
    run_dir = run_dir or RUN_DIR
    if state is None:
        return (f"{run_dir} exists but records no testbed (an interrupted start?); "
                f"run `dualpath down` or `dualpath clean` first")
    owner = state.get("owner", {})
    topo = state.get("topology", {}).get("name", "?")
    ref = ProcRef(owner.get("pid", 0), owner.get("start", -1))
    if not ref.alive():
        return (f"a testbed of {topo} is recorded in {run_dir} but its owner (pid {ref.pid}) is gone; "
                f"run `dualpath down` to remove what it left")
    if owner.get("kind") == "detached":
        return (f"a testbed of {topo} is already up (detached, runner pid {ref.pid}, since "
                f"{state.get('started_at', '?')}); `dualpath status` shows it, `dualpath down` stops it")
    return (f"a testbed of {topo} is already up, owned by pid {ref.pid} ({owner.get('cmdline', '?')[:80]}); "
            f"it is torn down when that process ends")


def read(run_dir: Path | None = None) -> dict[str, Any] | None:
    """The recorded state, or None if there is no (readable) state file."""
    run_dir = run_dir or RUN_DIR
    try:
        return json.loads((run_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def write(state: dict[str, Any], run_dir: Path | None = None) -> None:
    """Write state.json atomically: a reader never sees half a file."""
    run_dir = run_dir or RUN_DIR
    tmp = run_dir / f".{STATE_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, run_dir / STATE_FILE)


def owner(state: dict[str, Any]) -> ProcRef:
    o = state.get("owner", {})
    return ProcRef(int(o.get("pid", 0)), int(o.get("start", -1)))


def live_owner(run_dir: Path | None = None) -> ProcRef | None:
    """The process that holds a testbed up right now, if the run directory records a live one."""
    st = read(run_dir)
    if st is None:
        return None
    ref = owner(st)
    return ref if ref.alive() else None


def release(run_dir: Path | None = None) -> None:
    run_dir = run_dir or RUN_DIR
    shutil.rmtree(run_dir, ignore_errors=True)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
