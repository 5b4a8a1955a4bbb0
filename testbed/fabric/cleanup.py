"""Find and remove whatever the testbed left behind, matched by its prefix only.

Leftovers are namespaces named dpt-*, links and bridges named dpt-* in the root
namespace (with their qdiscs), nft tables named dpt_* in the root namespace,
Mininet shells tagged mininet:dpt-*, any process living in one of those
namespaces, the tmpfs mounts of store roots (source dpt-store, under a run's
/var/tmp/dpt-run-* scratch folder), and the run directory of a testbed
(testbed/fabric/rundir.py) with its detached runner, which is known by the pid and start
time recorded there. With `hosts: docker` (testbed/fabric/containers.py) also the
containers named dpt-* of the testbed's own Docker daemon, that daemon and its
containerd and shims (known by the daemon's own roots in their command lines), and
their mounts. Nothing else is ever touched: no process is matched by a broad name,
and a Docker daemon of the user's is never contacted.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from dualpath.naming import PREFIX
from testbed.fabric import containers
from testbed.fabric import rundir
from testbed.fabric.guest_server import live_guest_taps
from testbed.fabric.shell import run

NETNS_DIR = Path("/run/netns")
MININET_TAG = f"mininet:{PREFIX}-"
TMPFS_SOURCE = f"{PREFIX}-store"  # a store root's own tmpfs (runs with a disk-full fault)
SCRATCH_GLOB = f"{PREFIX}-run-*"  # a run's scratch folders in /var/tmp


@dataclass
class Leftovers:
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    bridges: list[str] = field(default_factory=list)
    qdiscs: list[str] = field(default_factory=list)
    nft_tables: list[str] = field(default_factory=list)
    processes: list[int] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)
    run_dirs: list[str] = field(default_factory=list)
    containers: list[str] = field(default_factory=list)
    docker_daemon: list[int] = field(default_factory=list)  # our dockerd, its containerd and shims
    cgroups: list[str] = field(default_factory=list)  # the containers' parent cgroups

    def empty(self) -> bool:
        return not any(vars(self).values())

    def summary(self) -> str:
        parts = [f"{len(v)} {k.replace('_', ' ')}" for k, v in vars(self).items() if v]
        return ", ".join(parts) if parts else "nothing"


def _ns_inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _our_processes(ns_inodes: set[int]) -> list[int]:
    """PIDs of Mininet shells tagged with our prefix and of processes in our namespaces."""
    pids = []
    me = os.getpid()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ino = os.stat(d / "ns" / "net").st_ino
        except OSError:
            continue  # exited meanwhile, or a kernel thread
        if MININET_TAG in cmd or ino in ns_inodes:
            pids.append(int(d.name))
    return pids


def live_owners() -> set[int]:
    """PIDs of live processes that hold a testbed up now: the recorded owner of the run
    directory, and the parents of prefixed Mininet shells (Mininet's own process, which a
    `dualpath run` or a reproduce is). A shell whose owner died is re-parented to init, so
    what is left of a killed run has no live owner here, and this process is never counted."""
    owners = set()
    ref = rundir.live_owner()
    if ref is not None:
        owners.add(ref.pid)
    for pid in _our_processes(set()):
        ppid = rundir.parent_pid(pid) if MININET_TAG in _cmdline(pid) else None
        if ppid is not None and ppid > 1:
            owners.add(ppid)
    return owners - {os.getpid()}


def _our_mounts() -> list[str]:
    """Mount points of store tmpfs mounts, in this (the root) mount namespace."""
    out = []
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "tmpfs" and (
                parts[0] == TMPFS_SOURCE or parts[1].startswith(f"/var/tmp/{SCRATCH_GLOB[:-1]}")):
            out.append(parts[1].replace("\\040", " "))
    return sorted(set(out), key=len, reverse=True)  # the deepest first


def find_leftovers(exclude_pids: set[int] | None = None) -> Leftovers:
    left = Leftovers()
    left.mounts = _our_mounts()
    left.namespaces = sorted(p.name for p in NETNS_DIR.glob(f"{PREFIX}-*")) if NETNS_DIR.exists() else []
    inodes = {i for i in (_ns_inode(NETNS_DIR / n) for n in left.namespaces) if i is not None}
    # Mininet shells hold the namespaces of hosts; the bridges' shells live in ours, and what
    # else runs here is not ours to kill. Ours, not init's: /proc/1 may be unreadable even to
    # root in a container, and then every process here would have looked like a leftover.
    here = _ns_inode(Path("/proc/self/ns/net"))
    for pid in _our_processes(set()):
        ino = _ns_inode(Path(f"/proc/{pid}/ns/net"))
        if ino is not None and here is not None and ino != here:
            inodes.add(ino)
    runner = _detached_runner()
    left.processes = sorted((set(_our_processes(inodes)) | ({runner.pid} if runner else set()))
                            - (exclude_pids or set()))
    if rundir.RUN_DIR.exists():
        left.run_dirs.append(str(rundir.RUN_DIR))
    in_use = live_guest_taps()  # a cluster-test guest's NIC is no testbed's leftover while its owner lives
    for link in json.loads(run(["ip", "-j", "-d", "link", "show"]) or "[]"):
        name = link.get("ifname", "")
        if not name.startswith(f"{PREFIX}-") or name in in_use:
            continue
        kind = link.get("linkinfo", {}).get("info_kind", "")
        (left.bridges if kind == "bridge" else left.links).append(name)
        if link.get("qdisc") not in (None, "noqueue", "noop"):
            left.qdiscs.append(name)
    left.containers = containers.recorded_containers()
    left.docker_daemon = sorted(set(containers.daemon_processes()) - (exclude_pids or set()))
    left.mounts += [m for m in containers.our_mounts() if m not in left.mounts]
    left.cgroups = containers.cgroup_dirs()
    tables = json.loads(run(["nft", "-j", "list", "tables"], check=False) or '{"nftables": []}')
    for item in tables.get("nftables", []):
        t = item.get("table")
        if t and t["name"].startswith(f"{PREFIX}_"):
            left.nft_tables.append(f"{t['family']} {t['name']}")
    return left


def clean(verbose: bool = True, exclude_pids: set[int] | None = None) -> Leftovers:
    """Remove all leftovers; return what was found before removal."""
    found = find_leftovers(exclude_pids)
    rest = found
    runner = _detached_runner()
    if runner is not None and runner.pid not in (exclude_pids or set()):
        stop_runner(runner)  # it tears its own testbed down; whatever it could not is swept below
        rest = find_leftovers(exclude_pids)
    _kill(rest.processes)
    if rest.containers or rest.docker_daemon or rest.cgroups:
        _remove_containers(rest)
    for ns in rest.namespaces:
        run(["ip", "netns", "del", ns], check=False)
    for name in rest.links + rest.bridges:
        run(["ip", "link", "del", name], check=False)  # the peer end goes with it
    for table in rest.nft_tables:
        run(["nft", "delete", "table", *table.split()], check=False)
    for m in rest.mounts:  # before the scratch folders: rmtree must not empty a live mount
        run(["umount", "-l", m], check=False)
    rundir.release()
    scratch = sorted(Path("/var/tmp").glob(SCRATCH_GLOB))  # logs and store of failed runs
    for d in scratch:
        shutil.rmtree(d, ignore_errors=True)
    if verbose:
        extra = f", {len(scratch)} scratch folder(s) of earlier runs" if scratch else ""
        print(f"dualpath clean: removed {found.summary()}{extra}")
    return found


def _remove_containers(left: Leftovers) -> None:
    """Our containers go through our daemon (started for it if a killed run took it down):
    the data root's records are the daemon's to delete. Then the daemon and its remains go."""
    if left.containers:
        try:
            containers.start_daemon()
            containers.remove_containers()
        except Exception as e:  # the daemon and mounts below are still removed
            print(f"dualpath clean: containers {', '.join(left.containers)} not removed: {e}")
    containers.stop_daemon()


def _detached_runner() -> rundir.ProcRef | None:
    """The live runner of a detached testbed, if the run directory records one.

    Only a detached runner is ours to stop: a testbed owned through the Python API lives in
    the user's own process (a test session, a script), which is never killed from outside."""
    st = rundir.read()
    if st is None or st.get("owner", {}).get("kind") != "detached":
        return None
    ref = rundir.owner(st)
    return ref if ref.alive() else None


def stop_runner(ref: rundir.ProcRef, timeout_s: float = 30.0) -> bool:
    """SIGTERM a detached runner and wait until it has torn down and exited; SIGKILL it after
    `timeout_s`. Returns True if it exited by itself."""
    try:
        os.kill(ref.pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not ref.alive():
            return True
        time.sleep(0.02)
    if ref.alive():  # re-checked: the pid must still be that runner
        os.kill(ref.pid, signal.SIGKILL)
    return False


def remove_recorded(state: dict) -> list[str]:
    """Remove exactly what a run directory's state records (after its owner died, or --force):
    every process in its namespaces, its Mininet shells, its namespaces, bridges and links, and
    the run directory. Returns what was removed, one word per item kind."""
    names = [e["name"] for e in state.get("endpoints", [])]
    removed = []
    n = kill_processes_in(names)
    shells = [rundir.ProcRef.from_dict(s) for s in state.get("mininet_shells", [])]
    alive = [s.pid for s in shells if s.alive() and MININET_TAG in _cmdline(s.pid)]
    _kill(alive)
    if n or alive:
        removed.append(f"{n + len(alive)} processes")
    present = {p.name for p in NETNS_DIR.glob(f"{PREFIX}-*")} if NETNS_DIR.exists() else set()
    gone = [ns for ns in names if ns in present]
    for ns in gone:
        run(["ip", "netns", "del", ns], check=False)
    if gone:
        removed.append(f"{len(gone)} namespaces")
    links = [*state.get("bridges", []), *(n["bridge_dev"] for e in state.get("endpoints", []) for n in e["nics"])]
    existing = {l.get("ifname") for l in json.loads(run(["ip", "-j", "link", "show"]) or "[]")}
    dels = [l for l in links if l in existing]
    for link in dels:
        run(["ip", "link", "del", link], check=False)
    if dels:
        removed.append(f"{len(dels)} links")
    if state.get("containers"):
        _remove_containers(Leftovers(containers=sorted(state["containers"])))
        removed.append(f"{len(state['containers'])} containers and their daemon")
    if Path(state.get("run_dir", rundir.RUN_DIR)).exists():
        rundir.release(Path(state.get("run_dir", rundir.RUN_DIR)))
        removed.append("the run directory")
    return removed


def kill_processes_in(namespaces: list[str]) -> int:
    """Kill every process living in the named namespaces; return how many there were."""
    inodes = {i for i in (_ns_inode(NETNS_DIR / n) for n in namespaces) if i is not None}
    pids = [p for p in _our_processes(inodes) if MININET_TAG not in _cmdline(p)]
    _kill(pids)
    return len(pids)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _kill(pids: list[int], grace_s: float = 1.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if Path(f"/proc/{p}").exists() and not _zombie(p)]
            time.sleep(0.05)
        pids = alive
        if not pids:
            return


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (OSError, IndexError):
        return True
