"""A QEMU guest of the project's Debian VM image as a second server (make cluster-test).

The guest boots with a second NIC on a tap device of this machine (dpt-tap0, 10.79.0.1/24 here,
10.79.0.2 there, MTU 9000) and serves SSH on it (scripts/vm/serve_ssh.sh) with a key made for the
session; its host key goes into a known_hosts file of the session, so ssh checks it strictly. The
checkout is the same path in the guest (9p) and so is the VM's venv (build/vm/venv, an image of
it): exactly what a real second server must have (docs/cluster.md).

Under TCG the guest's CPU is 5-9x slower than this machine's and takes both cores: what runs in it
is UNFAITHFUL by design; correctness and bytes are what it proves.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from dualpath.naming import PREFIX
from testbed.fabric import rundir
from testbed.fabric.remote import clock_offset, close, run_on
from testbed.fabric.shell import run
from testbed.paths import REPO
from testbed.topology_servers import ServerSpec


TAP = f"{PREFIX}-tap0"
HOST_CIDR, GUEST_CIDR = "10.79.0.1/24", "10.79.0.2/24"
GUEST_IP = GUEST_CIDR.split("/")[0]
GUEST_ROOT = REPO / "build" / "cluster"  # inside the checkout: the guest sees it at the same path
VM_PYTHON = REPO / "build" / "vm" / "venv" / "bin" / "python"
STOP_FILE = f"/run/{PREFIX}-guest-stop"  # in the guest: scripts/vm/serve_ssh.sh powers off when it appears
STEP_TRIES = 3  # clock steps at most
STEP_GOOD_S = 0.005  # a clock this close needs no further step
BOOT_TIMEOUT_S = 420.0  # TCG boot and sshd: about 60 s on the 2-core dev machine


class GuestError(RuntimeError):
    """The guest did not come up as a server; the message says where its log is."""


class GuestServer:
    """Boot the guest as an SSH server for the length of a `with` block, then power it off and
    remove the tap. `spec()` is its entry for a topology's servers: list."""

    def __init__(self, run_id: str, life_s: int = 3600, smp: int = 1, mem_mb: int = 6144) -> None:
        self.dir = GUEST_ROOT / f"{PREFIX}-guest-{run_id}"
        self.life_s, self.smp, self.mem_mb = life_s, smp, mem_mb
        self.proc: subprocess.Popen | None = None
        self.boot_s: float | None = None
        self.clock_offset_s: float | None = None
        self.made_tap = False

    def spec(self, name: str = "guest", nic_gbps: float = 1.0) -> ServerSpec:
        return ServerSpec(name=name, ssh=f"root@{GUEST_IP}", identity_file=str(self.dir / "id"),
                          known_hosts=str(self.dir / "known_hosts"), python=str(VM_PYTHON),
                          address=GUEST_IP, nic_gbps=nic_gbps, mtu=9000)

    def __enter__(self) -> "GuestServer":
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self) -> None:
        if not VM_PYTHON.exists():
            raise GuestError(f"no VM venv at {VM_PYTHON}: run scripts/vm.sh build (make vm-image)")
        if Path(f"/sys/class/net/{TAP}").exists():
            raise GuestError(f"{TAP} exists: another guest server is running (one at a time), or a dead one's "
                             "tap is left (`dualpath clean` removes it)")
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in ("id", "id.pub", "ready", "stop", "known_hosts", "host_key.pub"):
            (self.dir / name).unlink(missing_ok=True)
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{PREFIX}-cluster", "-f", str(self.dir / "id")])
        run(["ip", "tuntap", "add", "dev", TAP, "mode", "tap"])
        self.made_tap = True
        run(["ip", "link", "set", TAP, "mtu", "9000", "up"])
        run(["ip", "addr", "add", HOST_CIDR, "dev", TAP])
        log = open(self.dir / "vm.log", "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            ["bash", str(REPO / "scripts" / "vm.sh"), "run", "--tap", TAP, "--timeout", str(self.life_s),
             "--smp", str(self.smp), "--mem", str(self.mem_mb), "--",
             "bash", "scripts/vm/serve_ssh.sh", str(self.dir), GUEST_CIDR],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        # the guest's process, its owner's, and this machine's boot: the folder is shared with the
        # guest itself (9p), whose own `dualpath clean` must not take this file for its own
        (self.dir / "vm.pid").write_text(f"{self.proc.pid} {os.getpid()} {_boot_id()}\n")
        while not (self.dir / "ready").exists():
            if self.proc.poll() is not None:
                raise GuestError(f"the guest ended (exit {self.proc.returncode}) before it served SSH; "
                                 f"see {self.dir / 'vm.log'}")
            if time.monotonic() - t0 > BOOT_TIMEOUT_S:
                raise GuestError(f"the guest did not serve SSH within {BOOT_TIMEOUT_S:g} s; see {self.dir / 'vm.log'}")
            time.sleep(1)
        self.boot_s = time.monotonic() - t0
        key = (self.dir / "host_key.pub").read_text().split()
        (self.dir / "known_hosts").write_text(f"{GUEST_IP} {key[0]} {key[1]}\n")
        self.clock_offset_s = self._set_clock()

    def _set_clock(self, steps: int = STEP_TRIES) -> float | None:
        """Step the guest's clock onto this machine's, as chrony would on a real server: the
        guest boots from a 1-second RTC and TCG's clock drifts (-693 ms measured without this).
        One process reads the guest's clock and sets it (clock_settime), so the step lands
        microseconds after its reading; `date -s "$(date ...)"` landed 70-110 ms late under TCG,
        and its residue varied (-44.5 ms left once, against prepare's 50 ms limit). Steps again
        while more than STEP_GOOD_S is left. Returns the offset left, as prepare measures it."""
        got = clock_offset(self.spec())
        for _ in range(steps):
            if got is None or abs(got[0]) <= STEP_GOOD_S:
                break
            run_on(self.spec(), [str(VM_PYTHON), "-c", "import sys, time; "
                                 "time.clock_settime(time.CLOCK_REALTIME, time.time() - float(sys.argv[1]))",
                                 f"{got[0]:.6f}"], timeout=60)
            got = clock_offset(self.spec())
        return got[0] if got else None

    def stop(self) -> None:
        """Ask the guest to power off (over SSH: a file made here reaches the guest's 9p view of
        the folder late, its cache being loose); after 90 s, end its process group. Remove the tap."""
        if self.proc is not None and self.proc.poll() is None:
            (self.dir / "stop").touch()
            if self.boot_s is not None:
                run_on(self.spec(), ["touch", STOP_FILE], timeout=30)
                close(self.spec())
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                _kill_tree(self.proc.pid)
                self.proc.wait(timeout=30)
        for name in ("vm.pid", "id", "id.pub", "known_hosts"):  # the run's key goes with it
            (self.dir / name).unlink(missing_ok=True)
        if self.made_tap:
            run(["ip", "link", "del", TAP], check=False)
            self.made_tap = False


def _kill_tree(pid: int) -> None:
    """End scripts/vm.sh and everything under it: `timeout` puts QEMU in a process group of its
    own, so the script's group alone would leave the guest running."""
    live = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += [c for c in live if rundir.parent_pid(c) == p]
    for p in reversed(tree):  # QEMU first, then timeout, tee and the script
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def _guests() -> list[tuple[Path, int, int]]:
    """(vm.pid file, guest's pid, owner's pid) of every guest folder that records a guest started
    on this machine since it booted."""
    out = []
    for pidfile in sorted(GUEST_ROOT.glob(f"{PREFIX}-guest-*/vm.pid")):
        try:
            pid, owner, boot = pidfile.read_text().split()
            if boot == _boot_id():
                out.append((pidfile, int(pid), int(owner)))
        except (ValueError, OSError):
            continue
    return out


def live_guest_taps() -> set[str]:
    """The tap of a guest whose owner still runs: in use, not a leftover."""
    return {TAP} if any(Path(f"/proc/{owner}").exists() for _, _, owner in _guests()) else set()


def stop_leftover_guests() -> list[str]:
    """Guests a killed session left (their folder's vm.pid names a live scripts/vm.sh whose owner
    is gone; a guest in use is left alone): ask each to stop, then end its process group.
    Returns the folders it stopped."""
    stopped = []
    for pidfile, pid, owner in _guests():
        if Path(f"/proc/{owner}").exists():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            pidfile.unlink(missing_ok=True)
            continue
        if "scripts/vm.sh" not in cmd:
            pidfile.unlink(missing_ok=True)
            continue
        _kill_tree(pid)  # its owner is gone, so no one can ask it over SSH
        pidfile.unlink(missing_ok=True)
        stopped.append(pidfile.parent.name)
    return stopped
