"""Docker-hosted nodes (topology `hosts: docker`): the testbed's own daemon and one container
per namespace of the fabric (their image: testbed/fabric/node_image.py).

The daemon is the testbed's alone. It is started here with its own socket, pid file, exec root
and data root (all named with the project's prefix) and a config file of its own, so a Docker
daemon that the user runs (its socket, its /var/lib/docker, its /etc/docker/daemon.json) is
never read or touched. It changes no host networking: no bridge, no iptables, no forwarding.
Every container runs with `--network none`; the fabric moves Mininet's veths into its network
namespace, as Mininet does for its own hosts.

The data root (the cached image) outlives a run; the exec root, the containers and the daemon
do not. `dualpath clean` finds what a killed run left: the daemon by its pid file, its shims and
containerd by the exec root in their command lines (never by a process name), its mounts by
path, and its containers in the data root.

A node process enters its container the way `runc exec` does: it joins the container's cgroups
(so the topology's CPU and memory limits hold it), then its mount, UTS, IPC and network
namespaces and its root (`enter_argv`). The containers share the host's PID namespace
(`--pid host`), so that the testbed signals a node process directly, as it does a Mininet host's:
`docker exec`'s client forwards no signal (a SIGTERM to it leaves the node running), and a
process that entered a PID namespace of its own is a child of the one that entered it.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from dualpath.naming import PREFIX
from testbed.fabric import rundir
from testbed.fabric.shell import CommandError
from testbed.paths import REPO

if TYPE_CHECKING:
    from testbed.topology import LimitsSpec

DOCKERD = "/usr/sbin/dockerd"  # Debian's docker.io: the daemon and the client of one version
DOCKER = "/usr/bin/docker"
EXEC_ROOT = Path("/run") / f"{PREFIX}-docker"
DATA_ROOT = Path("/var/lib") / f"{PREFIX}-docker"
SOCKET = EXEC_ROOT / "docker.sock"
PIDFILE = EXEC_ROOT / "dockerd.pid"
LOG = Path("/var/log") / f"{PREFIX}-dockerd.log"
START_TIMEOUT_S = 60.0
CGROUP_PARENT = f"/{PREFIX}-docker"  # every container's cgroups sit under this one, per hierarchy
SHM_BYTES = 256 << 20  # each container's own /dev/shm (the default 64 MiB is tight for torch)


class DockerUnavailableError(RuntimeError):
    """`hosts: docker` cannot run here; the message says what is missing and how to get it."""


@dataclass(frozen=True)
class Limits:
    """A container's cgroup limits; None leaves that resource unlimited."""

    cpus: float | None = None
    memory_bytes: int | None = None
    cpu_shares: int | None = None

    @classmethod
    def of(cls, spec: "LimitsSpec | None") -> "Limits":
        """From a topology's limits for one kind of container (testbed.topology.LimitsSpec)."""
        if spec is None:
            return cls()
        return cls(spec.cpus, int(spec.memory_gib * 2**30) if spec.memory_gib else None, spec.cpu_shares)

    def docker_args(self) -> list[str]:
        return ([f"--cpus={self.cpus:g}"] if self.cpus else []) + \
               ([f"--cpu-shares={self.cpu_shares}"] if self.cpu_shares else []) + \
               ([f"--memory={self.memory_bytes}", f"--memory-swap={self.memory_bytes}"] if self.memory_bytes else [])


def docker(*args: str, timeout: float = 60, check: bool = True, stdin: IO[bytes] | None = None) -> str:
    """The docker client, always on the testbed's own socket (never $DOCKER_HOST), with the
    classic builder (Debian's docker.io ships no buildx); `stdin` feeds it (a build context)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")} | {"DOCKER_BUILDKIT": "0"}
    try:
        p = subprocess.run([DOCKER, "-H", f"unix://{SOCKET}", *args], capture_output=True, timeout=timeout,
                           env=env, stdin=stdin)
    except FileNotFoundError:
        raise DockerUnavailableError(f"{DOCKER} missing: `hosts: docker` needs Debian's docker.io "
                                     "(apt-get install docker.io)") from None
    except subprocess.TimeoutExpired:
        raise CommandError(f"docker {' '.join(args[:3])} timed out after {timeout:g}s") from None
    out, err = p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")
    if check and p.returncode != 0:
        raise CommandError(f"docker {' '.join(args[:3])} failed: {(err or out).strip()[-300:]}")
    return out


# -- the daemon ------------------------------------------------------------------------------------
def daemon_pid() -> int | None:
    """Our dockerd's pid, if it runs (its pid file names it and its command line has our exec root)."""
    try:
        pid = int(PIDFILE.read_text().strip())
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if f"--exec-root={EXEC_ROOT}\0".encode() in cmd else None


def start_daemon() -> int:
    """Start the testbed's dockerd (or find it running) and wait until it answers; its pid.
    Storage: overlay2, which shares the image's layers (seven containers start in about 2 s);
    where the kernel or the data root's file system cannot stack overlays (a data root on
    overlayfs, inside a container), vfs, which copies the image into every container."""
    if not Path(DOCKERD).exists():
        raise DockerUnavailableError(f"{DOCKERD} missing: `hosts: docker` needs Debian's docker.io "
                                     "(apt-get install docker.io; scripts/bootstrap.sh installs it)")
    pid = daemon_pid()
    if pid is not None:
        return pid
    EXEC_ROOT.mkdir(parents=True, exist_ok=True)
    DATA_ROOT.mkdir(parents=True, exist_ok=True)
    config = EXEC_ROOT / "daemon.json"  # ours, so that /etc/docker/daemon.json is never read
    config.write_text("{}\n")
    errors = []
    for driver in STORAGE_DRIVERS:
        try:
            return _start(driver, config)
        except DockerUnavailableError as e:
            errors.append(f"{driver}: {e}")
    raise DockerUnavailableError("; ".join(errors))


# overlay2 first (see start_daemon); vfs where overlays cannot stack
STORAGE_DRIVERS = ("overlay2", "vfs")


def _start(driver: str, config: Path) -> int:
    argv = [DOCKERD, f"--data-root={DATA_ROOT}", f"--exec-root={EXEC_ROOT}", f"--host=unix://{SOCKET}",
            f"--pidfile={PIDFILE}", f"--config-file={config}", f"--storage-driver={driver}",
            f"--cgroup-parent={CGROUP_PARENT}",  # ours (not /docker, which a user's daemon shares)
            # no host networking changes: every container is --network none
            "--bridge=none", "--iptables=false", "--ip6tables=false", "--ip-forward=false",
            "--ip-masq=false", "--userland-proxy=false"]
    with open(LOG, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # a Ctrl-C to the run is the testbed's to handle
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DockerUnavailableError(f"dockerd exited with {proc.returncode} at start: {_tail(LOG)} (log: {LOG})")
        if SOCKET.exists() and subprocess.run([DOCKER, "-H", f"unix://{SOCKET}", "version"],
                                              capture_output=True, timeout=10).returncode == 0:
            return proc.pid
        time.sleep(0.2)
    proc.kill()
    proc.wait(10)
    raise DockerUnavailableError(f"dockerd did not answer within {START_TIMEOUT_S:g}s (log: {LOG})")


def stop_daemon(timeout_s: float = 20.0) -> None:
    """Stop our dockerd, then whatever of it outlived it (containerd, shims), and its exec root."""
    pid = daemon_pid()
    if pid is not None:
        _signal_and_wait([pid], timeout_s)
    _signal_and_wait(daemon_processes(), 5.0)
    for m in our_mounts():
        subprocess.run(["umount", "-l", m], capture_output=True)
    remove_cgroup_dirs()
    shutil.rmtree(EXEC_ROOT, ignore_errors=True)


def daemon_processes() -> list[int]:
    """Every process whose command line names our exec root or data root: dockerd, its
    containerd and the containers' shims. Never matched by name: a user's dockerd has other roots."""
    roots = (str(EXEC_ROOT).encode(), str(DATA_ROOT).encode())
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if any(r in cmd for r in roots):
                out.append(int(d.name))
    return out


def our_mounts() -> list[str]:
    """Mount points at or under our exec root or data root: the containers' root file systems and
    namespace files, and the data root itself, which dockerd binds onto itself to make private."""
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        target = line.split()[1].replace("\\040", " ")
        if any(target == str(r) or target.startswith(f"{r}/") for r in (EXEC_ROOT, DATA_ROOT)):
            out.append(target)
    return sorted(set(out), key=len, reverse=True)  # the deepest first


def _signal_and_wait(pids: list[int], timeout_s: float) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (timeout_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        if not any(_alive(p) for p in pids):
            return


def _alive(pid: int) -> bool:
    if rundir.proc_start(pid) is not None:  # also None for a zombie
        return True
    try:  # a zombie child of ours (the dockerd this process started): reap it
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return False


def _tail(path: Path) -> str:
    try:
        lines = [l for l in path.read_text(errors="replace").splitlines() if l.strip()]
    except OSError:
        return ""
    return lines[-1][-300:] if lines else ""


# -- containers ------------------------------------------------------------------------------------
def run_container(name: str, image: str, shares: list[tuple[Path, bool]], limits: Limits = Limits()) -> int:
    """Start container `name` (no network) with `shares` bind-mounted at their own paths
    ((path, writable) pairs); the pid of its init process."""
    mounts = []
    for path, writable in shares:
        mounts += ["--mount", f"type=bind,source={path},target={path}{'' if writable else ',readonly'}"]
    docker("run", "--detach", "--name", name, "--hostname", name.removeprefix(f"{PREFIX}-"),
           "--network", "none", "--pid", "host", f"--shm-size={SHM_BYTES}", "--label", f"{PREFIX}=1",
           *limits.docker_args(), *mounts, image, "sleep", "infinity")
    return int(docker("inspect", "--format", "{{.State.Pid}}", name).strip())


def remove_containers() -> list[str]:
    """Remove (killing first) every container of ours; their names. The daemon is the testbed's,
    so what it holds is the testbed's."""
    removed: list[str] = []
    for attempt in range(3):  # a container whose init just died may still be "in removal"
        left = [n for n in docker("ps", "--all", "--format", "{{.Names}}").split() if n.startswith(f"{PREFIX}-")]
        if not left:
            return sorted(set(removed))
        removed += left
        out = docker("rm", "--force", "--volumes", *left, timeout=120, check=False)
        time.sleep(0.5 * attempt)
    raise CommandError(f"containers {', '.join(left)} not removed: {out.strip()[-200:]}")


def recorded_containers() -> list[str]:
    """Our containers as the data root records them, readable with the daemon down."""
    out = []
    for cfg in (DATA_ROOT / "containers").glob("*/config.v2.json"):
        try:
            name = json.loads(cfg.read_text()).get("Name", "").lstrip("/")
        except (OSError, ValueError):
            continue
        if name.startswith(f"{PREFIX}-"):
            out.append(name)
    return sorted(out)


def weigh_containers(n: int) -> None:
    """Give the containers' parent cgroup the CPU weight of `n` processes. The conductor and the
    instruments run in the root cgroup, where each busy thread weighs 1024 on its own, while the
    containers below their parent share that parent's one weight: with both cores contended the
    nodes lost. Measured (dualpath-mode runs of 1p1d-io at scale 0.0025, two each): 6 and 8
    prefill passes overran without this, 0 and 0 in namespaces."""
    for d in cgroup_dirs():
        if Path(d, "cpu.shares").exists():  # v1
            Path(d, "cpu.shares").write_text(str(1024 * n))
        elif Path(d, "cpu.weight").exists():  # v2: 100 is one process's default
            Path(d, "cpu.weight").write_text(str(min(10000, 100 * n)))


def cgroup_dirs() -> list[str]:
    """Our parent cgroup's directory in every hierarchy where it exists (the daemon makes them)."""
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, target, fstype, *_ = line.split()
        if fstype in ("cgroup", "cgroup2") and os.path.isdir(target + CGROUP_PARENT):
            out.append(target + CGROUP_PARENT)
    return out


def remove_cgroup_dirs() -> None:
    """rmdir our parent cgroups, deepest first (a cgroup directory goes only once it is empty)."""
    for top in cgroup_dirs():
        for d in sorted((p for p in Path(top).rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            try:
                d.rmdir()
            except OSError:
                pass
        try:
            Path(top).rmdir()
        except OSError:
            pass


def cgroup_procs_files(pid: int) -> list[str]:
    """The cgroup.procs file of every hierarchy that holds `pid`."""
    return procs_files(Path("/proc/self/mounts").read_text(), Path(f"/proc/{pid}/cgroup").read_text())


def procs_files(mounts: str, cgroups: str) -> list[str]:
    """From /proc/self/mounts and /proc/PID/cgroup: the cgroup.procs file of each hierarchy
    (v1: one per controller mount, matched by its controllers; v2: the unified tree) where the
    process is not at the root."""
    where = {}  # frozenset of controllers (empty for v2) -> mount point
    for line in mounts.splitlines():
        _, target, fstype, opts, *_ = line.split()
        if fstype == "cgroup2":
            where[frozenset()] = target
        elif fstype == "cgroup":
            where[frozenset(o for o in opts.split(",") if o in _CONTROLLERS or o.startswith("name="))] = target
    out = []
    for line in cgroups.splitlines():
        _, ctrls, path = line.split(":", 2)
        key = frozenset(c for c in ctrls.split(",") if c)
        if key in where and path != "/":
            out.append(f"{where[key]}{path}/cgroup.procs")
    return out


_CONTROLLERS = {"cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "net_cls", "blkio", "perf_event",
                "net_prio", "hugetlb", "pids", "rdma", "misc"}


def enter_argv(pid: int, argv: list[str]) -> list[str]:
    """argv prefixed to run inside the container whose init is `pid`: its cgroups first (a child
    started later inherits them), then its mount, UTS, IPC and network namespaces and its root."""
    files = " ".join(shlex.quote(f) for f in cgroup_procs_files(pid))
    join = f'for f in {files}; do echo $$ > "$f" || exit 125; done; exec "$@"'
    return ["sh", "-c", join, f"{PREFIX}-enter", "nsenter", f"--target={pid}", "--mount", "--uts", "--ipc", "--net",
            "--root", "--wd", "--", *argv]
