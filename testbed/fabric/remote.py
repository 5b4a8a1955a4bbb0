"""The other servers of a topology: SSH to them, check what a run needs there, clean them.

One multiplexed SSH connection per server, as Mininet's cluster edition keeps (its RemoteMixin's
ControlMaster): the first command opens it, later ones ride it, and `close` ends it. Its socket is
/tmp/dpt-ssh-<hash>, so `dualpath clean` finds a master a killed run left. Commands run as root
in the checkout's path on every server (docs/cluster.md says why the path must match).

`prepare` runs one shell script on each server (this machine too) that reports, one line per
check, whether it has the checkout, the venv, root, and a kernel that makes gretap tunnels,
bridges and HTB qdiscs (by making one of each, named with the prefix, and removing it); then
it measures each remote server's clock against this one and the path MTU the tunnels need.
"""
from __future__ import annotations

import re
import select
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dualpath.naming import PREFIX
from testbed.fabric.shell import run
from testbed.paths import REPO
from testbed.placement import VXLAN_PORT, Tunnel, crossings, overhead_bytes, servers, tunnels
from testbed.topology import Topology
from testbed.topology_servers import ServerSpec


CONTROL_DIR = Path("/tmp")
CONTROL_GLOB = f"{PREFIX}-ssh-*"
SSH_TIMEOUT_S = 60.0  # one command over SSH, a check script or a remote clean
CLOCK_TOLERANCE_S = 0.05  # a run's verdicts read each server's own monotonic clock; only logs compare wall clocks


@dataclass(frozen=True)
class Check:
    """One check on one server: passed, or the problem and its fix in one line."""

    server: str
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{self.server}: {self.name}: {self.detail}" if self.ok else f"{self.server}: PROBLEM {self.name}: {self.detail}"


def python_of(server: ServerSpec) -> str:
    """The venv's python on a server: its own `python:` or this one's path."""
    return server.python or sys.executable


def _ssh_options(server: ServerSpec) -> list[str]:
    trust = (["-o", f"UserKnownHostsFile={server.known_hosts}", "-o", "StrictHostKeyChecking=yes"]
             if server.known_hosts else ["-o", "StrictHostKeyChecking=accept-new"])
    argv = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "ServerAliveInterval=5",
            "-o", "ServerAliveCountMax=3", *trust, "-o", "ControlMaster=auto",
            "-o", f"ControlPath={CONTROL_DIR}/{PREFIX}-ssh-%C", "-o", "ControlPersist=60"]
    if server.port:
        argv += ["-p", str(server.port)]
    if server.identity_file:
        argv += ["-i", server.identity_file, "-o", "IdentitiesOnly=yes"]
    return argv


def ssh_argv(server: ServerSpec, command: str) -> list[str]:
    """ssh to a server with the project's options, running one shell command line there."""
    return ["ssh", *_ssh_options(server), "--", str(server.ssh), command]


def run_on(server: ServerSpec, argv: Sequence[str], stdin: str | None = None,
           timeout: float = SSH_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run argv on a server (this machine when it has no ssh), in the checkout. Never raises for
    the command's own failure: the caller reads returncode and output."""
    line = f"cd {shlex.quote(str(REPO))} && {shlex.join(argv)}"
    full = ssh_argv(server, line) if server.ssh else ["bash", "-c", line]
    try:
        feed = {"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}
        return subprocess.run(full, capture_output=True, text=True, timeout=timeout, **feed)
    except FileNotFoundError:
        return subprocess.CompletedProcess(full, 127, "", f"{full[0]}: command not found (install openssh-client)")
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(full, 124, "", f"no answer in {timeout:g} s")


def run_checked(server: ServerSpec, argv: Sequence[str], timeout: float = SSH_TIMEOUT_S) -> str:
    """run_on, raising CommandError (the command's last line) when it fails; its stdout."""
    from testbed.fabric.shell import CommandError

    p = run_on(server, argv, timeout=timeout)
    if p.returncode != 0:
        raise CommandError(f"server {server.name}: {shlex.join(argv)[:120]} failed: "
                           f"{_last_line(p.stderr) or _last_line(p.stdout) or 'exit ' + str(p.returncode)}")
    return p.stdout


def remote_argv(server: ServerSpec, ns: str, argv: list[str], env: dict[str, str]) -> list[str]:
    """ssh argv that runs argv as a process of namespace `ns` on `server`, in the checkout, with
    `env` set there; this machine's python becomes the server's. Its stdin, stdout and stderr
    are the ssh client's, so a node process's secret and ready line pass as they do here."""
    if argv and argv[0] == sys.executable:
        argv = [python_of(server), *argv[1:]]
    sets = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return ssh_argv(server, f"cd {shlex.quote(str(REPO))} && exec env {sets} ip netns exec {shlex.quote(ns)} "
                            f"{shlex.join(argv)}")


def close(server: ServerSpec) -> None:
    """End the server's shared SSH connection, if one is open."""
    if server.ssh:
        subprocess.run(["ssh", *_ssh_options(server), "-O", "exit", "--", str(server.ssh)],
                       capture_output=True, timeout=10, stdin=subprocess.DEVNULL)


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


# Run with bash on every server: args REPO PYTHON TUNNEL. One line per check: name, ok|problem, detail.
_CHECK_SCRIPT = r"""
set -u
repo=$1; py=$2; tunnel=$3; P=__PREFIX__-prep
say() { printf '%s\t%s\t%s\n' "$1" "$2" "$3"; }
cleanup() { ip link del "$P-g" 2>/dev/null; ip link del "$P-v0" 2>/dev/null; ip link del "$P-br" 2>/dev/null; }
trap cleanup EXIT
if [ "$(id -u)" = 0 ]; then say root ok "uid 0"; else say root problem "runs as uid $(id -u); fix: ssh as root (the testbed makes namespaces and qdiscs)"; fi
commit_of() {  # the checkout's commit, with git or from .git itself
  git -c safe.directory='*' -C "$repo" rev-parse HEAD 2>/dev/null && return
  local h; h=$(cat "$repo/.git/HEAD" 2>/dev/null) || { echo "no .git"; return; }
  case $h in "ref: "*) cat "$repo/.git/${h#ref: }" 2>/dev/null || grep " ${h#ref: }\$" "$repo/.git/packed-refs" 2>/dev/null | cut -d' ' -f1 || echo "unknown";;
    *) echo "$h";; esac
}
if [ -f "$repo/testbed/__init__.py" ]; then
  say checkout ok "$(commit_of)"
else say checkout problem "no checkout at $repo; fix: clone the project at the same path as on the first server"; fi
if [ ! -x "$py" ]; then say python problem "no python at $py; fix: make setup in the checkout there, or set the server's python:"
elif out=$(cd "$repo" 2>/dev/null && "$py" -c 'import sys, testbed, dualpath, mininet.net, torch; print(sys.version.split()[0])' 2>&1); then
  say python ok "$py $out"
else say python problem "$py cannot import the testbed ($(printf '%s' "$out" | tail -n 1 | cut -c1-160)); fix: make setup there"; fi
missing=""; for t in ip tc nft mnexec bash; do command -v "$t" >/dev/null 2>&1 || missing="$missing $t"; done
if [ -z "$missing" ]; then say tools ok "ip tc nft mnexec"; else say tools problem "missing:$missing; fix: scripts/bootstrap.sh there"; fi
if [ "$tunnel" = vxlan ]; then args="vxlan id 1 local 127.0.0.1 remote 127.0.0.2 dstport __VXLAN_PORT__"; mod=vxlan
else args="gretap local 127.0.0.1 remote 127.0.0.2 key 1"; mod=ip_gre; fi
if out=$(ip link add "$P-g" type $args 2>&1); then say "$tunnel" ok "made and removed one"
else say "$tunnel" problem "cannot make a $tunnel device ($out); fix: modprobe $mod, or set tunnel: to the other kind"; fi
if out=$(ip link add "$P-br" type bridge 2>&1); then say bridge ok "made and removed one"
else say bridge problem "cannot make a bridge ($out); fix: modprobe bridge"; fi
if out=$(ip link add "$P-v0" type veth peer name "$P-v1" 2>&1 && tc qdisc add dev "$P-v0" root handle 1: htb 2>&1); then
  say htb ok "shaped a veth and removed it"
else say htb problem "cannot shape a veth with HTB ($out); fix: modprobe veth sch_htb"; fi
sync=$(timedatectl show -p NTPSynchronized --value 2>/dev/null || true)
say ntp ok "NTPSynchronized=${sync:-unknown}"
"""


def _parse(server: str, proc: subprocess.CompletedProcess) -> list[Check]:
    out = []
    for line in proc.stdout.splitlines():
        parts = line.split("\t", 2)
        if len(parts) == 3 and parts[1] in ("ok", "problem"):
            out.append(Check(server, parts[0], parts[1] == "ok", parts[2]))
    if not out:
        why = _last_line(proc.stderr) or f"exit {proc.returncode}"
        out.append(Check(server, "ssh", False, f"cannot run commands there ({why}); fix: set up key-based SSH "
                         "as root (docs/cluster.md), then try `ssh` by hand"))
    return out


def _script() -> str:
    return _CHECK_SCRIPT.replace("__PREFIX__", PREFIX).replace("__VXLAN_PORT__", str(VXLAN_PORT))


def check_server(server: ServerSpec, tunnel: str) -> list[Check]:
    """The script's checks on one server."""
    # a slow server (a QEMU guest under TCG) takes a minute to import torch
    proc = run_on(server, ["bash", "-s", "--", str(REPO), python_of(server), tunnel], stdin=_script(), timeout=300)
    return _parse(server.name, proc)


def _same_commit(checks: list[Check], here: str) -> list[Check]:
    """A remote checkout at another commit than this machine's is a problem: the two sides
    would speak different versions of the control protocol."""
    out = []
    for c in checks:
        if c.name == "checkout" and c.ok and c.detail != here and re.fullmatch(r"[0-9a-f]{40}", c.detail or ""):
            c = Check(c.server, c.name, False, f"at commit {c.detail[:12]}, this machine at {here[:12]}; "
                      "fix: check out the same commit there")
        out.append(c)
    return out


def best_offset(readings: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """(offset, uncertainty) of another clock from readings (sent, its reading, received) on
    this one (Cristian's method): its reading against the midpoint of the quickest round trip,
    uncertain by half that round trip."""
    t0, there, t1 = min(readings, key=lambda r: r[2] - r[0])
    return there - (t0 + t1) / 2, (t1 - t0) / 2


# Reads the wall clock with a shell builtin, once per line in: no process starts per reading. Over
# `date` (bash and date started for each) the quickest of 3 round trips to the TCG guest was 126-
# 146 ms, so prepare's 50 ms limit rested on +-63-73 ms of uncertainty.
_CLOCK_LOOP = 'while read -r _; do echo "${EPOCHREALTIME:-}"; done'
CLOCK_READINGS = 9


def clock_offset(server: ServerSpec, tries: int = CLOCK_READINGS) -> tuple[float, float] | None:
    """(offset, uncertainty) in seconds of the server's wall clock against this one's: `tries`
    readings through one shell kept open on it (this machine's own without ssh), best_offset of
    them. None when it cannot be read (no bash 5's EPOCHREALTIME, or no answer)."""
    argv = ssh_argv(server, f"bash -c {shlex.quote(_CLOCK_LOOP)}") if server.ssh else ["bash", "-c", _CLOCK_LOOP]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True, bufsize=1)
    except FileNotFoundError:
        return None
    readings = []
    try:
        for _ in range(tries):
            if not select.select([], [proc.stdin], [], 15)[1]:
                return None
            t0 = time.time()
            proc.stdin.write("\n")
            proc.stdin.flush()
            if not select.select([proc.stdout], [], [], 15)[0]:
                return None
            line = proc.stdout.readline()
            t1 = time.time()
            readings.append((t0, float(line.strip().replace(",", ".")), t1))
    except (ValueError, OSError):
        return None
    finally:
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return best_offset(readings)


def _clock_check(server: ServerSpec) -> Check:
    got = clock_offset(server)
    if got is None:
        return Check(server.name, "clock", False, "could not read its clock over ssh (bash 5's EPOCHREALTIME)")
    off, err = got
    ok = abs(off) <= CLOCK_TOLERANCE_S + err
    detail = f"{off * 1e3:+.1f} ms against this machine (+-{err * 1e3:.1f} ms)"
    return Check(server.name, "clock", ok, detail if ok else f"{detail}; fix: run chrony or systemd-timesyncd on every server")


def address_of(server: ServerSpec) -> str | None:
    """The IPv4 address tunnels reach the server at: `address:`, else its ssh host's."""
    if server.address:
        return server.address
    host = str(server.ssh).rsplit("@", 1)[-1].strip("[]")
    if re.fullmatch(r"\d{1,3}(\.\d{1,3}){3}", host):
        return host
    p = subprocess.run(["getent", "ahostsv4", host], capture_output=True, text=True, timeout=10)
    found = re.findall(r"^(\d+\.\d+\.\d+\.\d+)", p.stdout, re.M)
    return found[0] if found else None


def _mtu_check(server: ServerSpec, need: int, toward: str) -> Check:
    """A don't-fragment packet of the tunnels' size from the server to this machine's tunnel
    address (ping is on every server image; this machine's may have none)."""
    p = run_on(server, ["ping", "-M", "do", "-s", str(need - 28), "-c", "1", "-W", "2", toward], timeout=30)
    if p.returncode == 0:
        return Check(server.name, "path MTU", True, f"a {need}-byte packet reached {toward} unfragmented")
    why = _last_line(p.stdout + p.stderr) or "no reply"
    fix = ("install iputils-ping there" if p.returncode == 127 or "not found" in why
           else "raise the NICs' MTU on the path, or lower the topology's mtu:")
    return Check(server.name, "path MTU", False, f"a {need}-byte don't-fragment ping (the topology's mtu and the "
                 f"tunnel's header) from it to {toward} failed ({why}); fix: {fix}")


NUMERICS_TIMEOUT_S = 300.0  # a torch import and the demo model's probe: about 25 s in the TCG guest


def cpu_fields_of(server: ServerSpec) -> list[int] | None:
    """The jiffies of /proc/stat's cpu line on the server, or None when it could not be read."""
    p = run_on(server, ["head", "-n1", "/proc/stat"], timeout=SSH_TIMEOUT_S)
    parts = p.stdout.split()
    if p.returncode != 0 or len(parts) < 9 or parts[0] != "cpu" or not all(x.isdigit() for x in parts[1:]):
        return None
    return [int(x) for x in parts[1:]]


def numerics_hash(server: ServerSpec | None, checkpoint: Path) -> tuple[str | None, str]:
    """(hash, '') of `python -m dualpath.model.numerics` on the server (None: this machine), or
    (None, why it gave none)."""
    argv = [sys.executable if server is None else python_of(server), "-m", "dualpath.model.numerics", str(checkpoint)]
    env_set = ["env", f"PYTHONPATH={REPO}", "OMP_NUM_THREADS=1"]
    if server is None:
        p = subprocess.run([*env_set, *argv], cwd=REPO, capture_output=True, text=True, timeout=NUMERICS_TIMEOUT_S)
    else:
        p = run_on(server, ["bash", "-c", f"cd {shlex.quote(str(REPO))} && {shlex.join([*env_set, *argv])}"],
                   timeout=NUMERICS_TIMEOUT_S)
    out = p.stdout.strip()
    if p.returncode == 0 and re.fullmatch(r"[0-9a-f]{16}", out):
        return out, ""
    return None, _last_line(p.stderr) or _last_line(out) or f"exit {p.returncode}"


def _numerics_check(server: ServerSpec, checkpoint: Path, here: tuple[str | None, str]) -> Check:
    """The server computes the demo model's probe to this machine's bits (`here`: numerics_hash
    of this machine) with the portable kernels (dualpath/model/numerics.py), or its tokens would
    not verify against the reference."""
    want, why_not_here = here
    if want is None:
        return Check(server.name, "numerics", False, f"this machine gave no probe hash ({why_not_here})")
    got, why = numerics_hash(server, checkpoint)
    if got is None:
        return Check(server.name, "numerics", False, f"no probe hash ({why}); fix: the checkout's build/checkpoints "
                     "must be there too (copy it, or run make setup there)")
    if got != want:
        return Check(server.name, "numerics", False, f"the demo model's probe hashes {got} there, {want} here with the "
                     "same portable kernels; fix: the same torch version on every server (its MKL and kernels)")
    return Check(server.name, "numerics", True, f"the demo model's probe hashes {got}, as here (portable kernels)")


def prepare(topo: Topology) -> list[Check]:
    """Every check on every server of the topology, this machine's first."""
    here = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    need = topo.spec.mtu + overhead_bytes(topo)
    apart = {name for c in crossings(topo) for name in (c.a, c.b)}
    toward: str | RuntimeError | None = None  # this machine's tunnel address, looked up once
    from dualpath.model.registry import prepare_tiny  # (torch: only prepare needs it, not a fabric)

    checkpoint = prepare_tiny()  # the model `dualpath run` loads unless told otherwise
    here_hash = numerics_hash(None, checkpoint)  # what every other server's probe must give
    checks: list[Check] = []
    for v in servers(topo):
        got = _same_commit(check_server(v, topo.spec.tunnel), here)
        checks += got
        if v.ssh and all(c.ok for c in got if c.name == "ssh"):
            checks.append(_clock_check(v))
            if v.name in apart:
                if toward is None:
                    try:
                        toward = _first_address(topo)
                    except RuntimeError as e:
                        toward = e
                checks.append(_mtu_check(v, need, toward) if isinstance(toward, str)
                              else Check(v.name, "path MTU", False, str(toward)))
            checks.append(_numerics_check(v, checkpoint, here_hash))
        close(v)
    return checks


def clean_remote(topo: Topology) -> list[Check]:
    """`dualpath clean` on every other server of the topology, each in its own checkout."""
    out = []
    for v in servers(topo):
        if not v.ssh:
            continue
        p = run_on(v, [python_of(v), "-m", "testbed.cli", "clean"], timeout=300)
        detail = _last_line(p.stdout) or _last_line(p.stderr) or f"exit {p.returncode}"
        out.append(Check(v.name, "clean", p.returncode == 0, detail))
        close(v)
    return out


def close_leftover_masters() -> list[str]:
    """SSH control masters a killed run left (their sockets carry the prefix): ask each to exit."""
    closed = []
    for sock in sorted(CONTROL_DIR.glob(CONTROL_GLOB)):
        if sock.is_socket():
            subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "dpt-leftover"],
                           capture_output=True, timeout=10, stdin=subprocess.DEVNULL)
            closed.append(sock.name)
    return closed


# -- the other servers' parts of a fabric (testbed/fabric/network.py's Fabric leads) ---------

def _topology_file(topo: Topology) -> str:
    return f"/var/tmp/{PREFIX}-cluster-{topo.name}.yaml"


def up_parts(topo: Topology, remotes: Sequence[ServerSpec]) -> None:
    """Bring up each remote server's part of the fabric: the topology goes over SSH to a file of
    the prefix, and `dualpath up FILE --server NAME --detach` builds there what is placed there
    (the same code as here: namespaces, NICs, shaping, marks). Raises with the server's own
    one-line error; the caller's down() then takes every server's part down."""
    import yaml

    text = yaml.safe_dump(topo.spec.model_dump(mode="json", exclude_none=True), sort_keys=False)
    path = _topology_file(topo)
    for v in remotes:
        p = run_on(v, ["bash", "-c", f"umask 077 && cat > {shlex.quote(path)}"], stdin=text)
        if p.returncode == 0:
            p = run_on(v, [python_of(v), "-m", "testbed.cli", "up", path, "--server", v.name, "--detach"], timeout=900)
        if p.returncode != 0:
            why = _last_line(p.stderr) or _last_line(p.stdout) or f"exit {p.returncode}"
            raise RuntimeError(f"server {v.name}: its part of the fabric did not come up ({why})")


def down_parts(topo: Topology, remotes: Sequence[ServerSpec]) -> list[str]:
    """Take each remote server's part down, its tunnel ends and topology file too. Returns the
    errors, one line each (the caller goes on with its own part)."""
    errors = []
    devs = [t.dev for t in tunnels(topo)]
    for v in remotes:
        p = run_on(v, [python_of(v), "-m", "testbed.cli", "down"], timeout=300)
        if p.returncode != 0 and "nothing" not in (p.stdout + p.stderr):
            errors.append(f"server {v.name}: down: {_last_line(p.stderr) or _last_line(p.stdout)}")
        script = "".join(f"ip link del {d} 2>/dev/null; " for d in devs) + f"rm -f {shlex.quote(_topology_file(topo))}"
        run_on(v, ["bash", "-c", script], timeout=60)
        close(v)
    return errors


def _first_address(topo: Topology) -> str:
    """This machine's address toward the others: its `address:`, else the source address of
    its route to the first other server."""
    first = servers(topo)[0]
    if first.address:
        return first.address
    peer = next((address_of(v) for v in servers(topo)[1:]), None)
    out = subprocess.run(["ip", "-o", "route", "get", str(peer)], capture_output=True, text=True).stdout
    found = re.search(r"\bsrc (\d+\.\d+\.\d+\.\d+)", out)
    if not found:
        raise RuntimeError(f"no route from this machine to {peer}; fix: set the first server's address:")
    return found.group(1)


def tunnel_lines(t: Tunnel, local: str, remote: str, bridge: str, mtu: int) -> list[str]:
    """`ip -batch` lines that make one end of a tunnel and enslave it to its bridge."""
    if t.kind == "vxlan":
        make = f"link add {t.dev} type vxlan id {t.key} local {local} remote {remote} dstport {VXLAN_PORT}"
    else:
        make = f"link add {t.dev} type gretap local {local} remote {remote} key {t.key} ttl 64"
    return [make, f"link set dev {t.dev} mtu {mtu} master {bridge} up"]


def join_bridges(topo: Topology, bridges: dict[str, str], made: list[str]) -> None:
    """Make both ends of every tunnel (this machine's and the remote servers'), adding the
    devices made on this machine to `made` as they are made (a failure half-way leaves it
    right for the caller's teardown). `bridges`: "compute"/"storage" -> the bridge's name."""
    by_name = {v.name: v for v in servers(topo)}
    first = servers(topo)[0].name
    addr = {v.name: (_first_address(topo) if v.name == first else address_of(v)) for v in servers(topo)}
    for t in tunnels(topo):
        for side, other in ((t.a, t.b), (t.b, t.a)):
            if addr[side] is None or addr[other] is None:
                raise RuntimeError(f"no IPv4 address for server {side if addr[side] is None else other}; fix: set address:")
            lines = "\n".join(tunnel_lines(t, str(addr[side]), str(addr[other]), bridges[t.bridge], topo.spec.mtu)) + "\n"
            if side == first:
                made.append(t.dev)
                run(["ip", "-batch", "-"], stdin=lines)
            else:
                p = run_on(by_name[side], ["ip", "-batch", "-"], stdin=lines)
                if p.returncode != 0:
                    raise RuntimeError(f"server {side}: cannot make tunnel {t.dev} ({_last_line(p.stderr)})")
