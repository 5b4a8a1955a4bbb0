"""`hosts: docker`: every namespace of the fabric is a container of the testbed's own Docker daemon.

The pure parts (cgroup paths, the entry command, limits, the topology field) run anywhere; the
wiring runs as root with Debian's docker.io (scripts/bootstrap.sh installs it)."""
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from testbed.fabric import containers

from testbed.fabric import node_image
from testbed.fabric.cleanup import clean, find_leftovers
from testbed.topology import ContainerLimitsSpec, LimitsSpec, TopologyError, load_topology
from tests.conftest import REPO, dualpath, is_root

needs_docker = pytest.mark.skipif(not (is_root() and Path(containers.DOCKERD).exists()),
                                  reason="needs root and Debian's docker.io")
TOPO = REPO / "topologies" / "1p1d.yaml"

V1_MOUNTS = """cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/net_cls,net_prio cgroup rw,relatime,net_cls,net_prio 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,xattr,name=systemd 0 0
"""


def test_procs_files_match_each_hierarchy_by_its_controllers():
    got = containers.procs_files(V1_MOUNTS, "4:memory:/docker/ab\n3:net_cls,net_prio:/docker/ab\n"
                                            "2:cpu:/docker/ab\n1:name=systemd:/docker/ab\n5:pids:/\n")
    assert got == ["/sys/fs/cgroup/memory/docker/ab/cgroup.procs",
                   "/sys/fs/cgroup/net_cls,net_prio/docker/ab/cgroup.procs",
                   "/sys/fs/cgroup/cpu/docker/ab/cgroup.procs",
                   "/sys/fs/cgroup/systemd/docker/ab/cgroup.procs"]  # pids: at the root, not mounted: none
    v2 = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\n"
    assert containers.procs_files(v2, "0::/system.slice/docker-ab.scope\n") == [
        "/sys/fs/cgroup/system.slice/docker-ab.scope/cgroup.procs"]


def test_entry_joins_the_cgroups_before_the_namespaces(monkeypatch):
    monkeypatch.setattr(containers, "cgroup_procs_files", lambda pid: ["/cg/cpu/docker/x/cgroup.procs"])
    argv = containers.enter_argv(4242, ["python", "-m", "x"])
    assert argv[:2] == ["sh", "-c"] and "/cg/cpu/docker/x/cgroup.procs" in argv[2]
    assert argv[2].index("echo $$") < argv[2].index('exec "$@"')  # the cgroup first: children inherit it
    nsenter = argv[argv.index("nsenter"):]
    assert "--target=4242" in nsenter and {"--mount", "--net", "--uts", "--ipc", "--root"} <= set(nsenter)
    assert nsenter[-4:] == ["--", "python", "-m", "x"]


def test_limits_become_cgroup_options():
    assert containers.Limits().docker_args() == []
    assert containers.Limits(0.5, 1 << 30).docker_args() == [
        "--cpus=0.5", f"--memory={1 << 30}", f"--memory-swap={1 << 30}"]  # no swap beyond the limit
    assert containers.Limits(cpu_shares=4096).docker_args() == ["--cpu-shares=4096"]
    assert containers.Limits.of(LimitsSpec(memory_gib=0.5, cpu_shares=512)) == containers.Limits(None, 1 << 29, 512)
    assert containers.Limits.of(None) == containers.Limits()


def test_the_docker_client_never_follows_the_users_environment(monkeypatch):
    seen = {}

    def fake_run(argv, **kw):
        seen.update(argv=argv, env=kw["env"])
        return subprocess.CompletedProcess(argv, 0, b"", b"")

    monkeypatch.setenv("DOCKER_HOST", "unix:///run/users-own.sock")
    monkeypatch.setenv("DOCKER_CONTEXT", "theirs")
    monkeypatch.setenv("DOCKER_BUILDKIT", "1")
    monkeypatch.setattr(containers.subprocess, "run", fake_run)
    containers.docker("ps")
    assert seen["argv"][1:3] == ["-H", f"unix://{containers.SOCKET}"]
    assert {k: v for k, v in seen["env"].items() if k.startswith("DOCKER_")} == {"DOCKER_BUILDKIT": "0"}  # ours


def test_a_failed_image_build_says_why_and_streams_its_steps(monkeypatch, tmp_path):
    script = tmp_path / "build.sh"
    script.write_text('echo "[docker image +0s] debootstrap bookworm"\necho "E: no mirror" >&2\nexit 1\n')
    monkeypatch.setattr(node_image, "IMAGE_SCRIPT", script)
    seen = []
    with pytest.raises(containers.DockerUnavailableError) as e:
        node_image.ensure_base(progress=seen.append)
    assert seen == ["[docker image +0s] debootstrap bookworm"]
    assert "exit 1" in str(e.value) and "E: no mirror" in str(e.value)
    script.write_text('echo "[docker image +0s] cached: dpt-node:abc"\necho "image dpt-node:abc"\n')
    seen.clear()
    assert node_image.ensure_base(progress=seen.append) == "dpt-node:abc" and seen == []


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


def test_the_project_layer_holds_what_git_would_ship(tmp_path):
    """Tracked and untracked files, not the ignored ones nor a tracked file deleted in the tree;
    its tag follows the bytes, the exec bit, a link's target and the parent, not the times."""
    (tmp_path / "pkg").mkdir()
    for name, text in (("pkg/a.py", "a = 1\n"), ("gone.py", ""), (".gitignore", "/build/\n*.pyc\n")):
        (tmp_path / name).write_text(text)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "x")
    (tmp_path / "gone.py").unlink()
    (tmp_path / "new.py").write_text("")
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "big.bin").write_bytes(bytes(10))
    (tmp_path / "pkg" / "a.pyc").write_bytes(b"")
    (tmp_path / "link").symlink_to("pkg/a.py")
    files = node_image.project_files(tmp_path)
    assert files == [".gitignore", "link", "new.py", "pkg/a.py"]
    tag = node_image.tree_tag(tmp_path, files, "dpt-node:1")
    os.utime(tmp_path / "pkg" / "a.py", (1, 1))
    assert node_image.tree_tag(tmp_path, files, "dpt-node:1") == tag  # times are not content
    assert node_image.tree_tag(tmp_path, files, "dpt-node:2") != tag
    changes = [lambda: (tmp_path / "pkg" / "a.py").write_text("a = 2\n"),
               lambda: (tmp_path / "pkg" / "a.py").chmod(0o755),
               lambda: ((tmp_path / "link").unlink(), (tmp_path / "link").symlink_to("new.py"))]
    seen = {tag}
    for change in changes:
        change()
        seen.add(node_image.tree_tag(tmp_path, files, "dpt-node:1"))
    assert len(seen) == 1 + len(changes)
    assert node_image.project_files(Path("/proc")) is None  # not a work tree: the image binds it instead


def test_the_venv_layer_follows_what_is_installed(tmp_path):
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (tmp_path / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (site / "torch-2.5.1.dist-info").mkdir()
    (site / "torch").mkdir()
    (site / "__editable__.x.pth").write_text("/work/a\n")
    tag = node_image.venv_tag(tmp_path, "dpt-node:1")
    (site / "torch" / "x.py").write_text("")  # a package's own files: the dist-info names its version
    assert node_image.venv_tag(tmp_path, "dpt-node:1") == tag
    (site / "__editable__.x.pth").write_text("/work/b\n")  # the editable install now points elsewhere
    tag2 = node_image.venv_tag(tmp_path, "dpt-node:1")
    (site / "torch-2.5.1.dist-info").rename(site / "torch-2.6.0.dist-info")
    tag3 = node_image.venv_tag(tmp_path, "dpt-node:1")
    assert len({tag, tag2, tag3, node_image.venv_tag(tmp_path, "dpt-node:2")}) == 4


@pytest.mark.parametrize("text, field", [
    ("hosts: vm\n", "hosts"),
    ("container_limits: {engine: {cpus: 0.5}}\n", "container_limits"),  # without hosts: docker
    ("hosts: docker\ncontainer_limits: {engine: {cpus: 0}}\n", "container_limits.engine.cpus"),
    ("hosts: docker\ncontainer_limits: {gpu: {cpus: 1}}\n", "container_limits.gpu"),
])
def test_bad_hosts_fields_get_one_line(tmp_path, text, field):
    p = tmp_path / "t.yaml"
    p.write_text(TOPO.read_text() + text)
    with pytest.raises(TopologyError) as e:
        load_topology(p)
    msg = str(e.value)
    assert "\n" not in msg and "fix:" in msg
    assert field in msg or "container_limits apply to hosts: docker only" in msg


def test_cli_rejects_an_unknown_hosts_value():
    r = dualpath("run", str(TOPO), "--hosts", "vm", timeout=60)
    assert r.returncode == 2 and "--hosts" in r.stderr and "Traceback" not in r.stderr


def test_cli_hosts_namespaces_on_a_docker_topology_drops_its_container_limits_and_says_so():
    docker = TOPO.parent / "1p1d-docker.yaml"
    assert load_topology(docker).spec.container_limits is not None
    r = dualpath("run", str(docker), "--hosts", "namespaces", "--modes", "no-such-mode", timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "container_limits apply to docker hosts only" in r.stderr and "no-such-mode" in r.stderr


# -- live ---------------------------------------------------------------------------------------
def _docker_topology(limits: ContainerLimitsSpec | None = None):
    t = load_topology(TOPO)
    return replace(t, spec=t.spec.model_copy(update={"hosts": "docker", "container_limits": limits}))


def _in(fab, ns: str, code: str, timeout: float = 60) -> str:
    p = subprocess.run(fab.exec_argv(ns, [sys.executable, "-c", code]), capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stderr[-500:]
    return p.stdout


def _htb_root_bytes(dev: str, ns: str) -> int:
    """Bytes the NIC's HTB root class (1:1, both classes under it) has sent."""
    from emulators.nic import parse_class_stats
    from testbed.fabric.shell import run

    return parse_class_stats(run(["tc", "-s", "class", "show", "dev", dev], ns=ns))["1:1"]


@needs_docker
def test_containers_wire_a_two_node_fabric(no_leftovers, tmp_path):
    """Each namespace is its container's; a node process runs in its container (cgroups, image,
    hostname) and its bytes cross the shaped NICs; the limits reach the cgroups; nothing is left."""
    from testbed.fabric.network import Fabric
    from testbed.fabric.shell import run

    limits = ContainerLimitsSpec(engine=LimitsSpec(cpus=0.5, memory_gib=1.0), host=LimitsSpec(cpu_shares=512))
    with Fabric(_docker_topology(limits), shares=[tmp_path]) as fab:
        assert set(containers.recorded_containers()) == {e.name for e in fab.endpoints}
        for ep in fab.endpoints:
            cpid = fab.containers[ep.name]
            assert os.stat(f"/proc/{cpid}/ns/net").st_ino == os.stat(f"/run/netns/{ep.name}").st_ino, ep.name
            ifs = {l.split()[0].split("@")[0] for l in run(["ip", "-br", "link"], ns=ep.name).splitlines()}
            assert ifs - {"lo"} == {n.dev for n in ep.nics}
        out = _in(fab, "dpt-p0e0", "import os, socket; print(socket.gethostname()); "
                                   f"print(open('/proc/self/cgroup').read().count('{containers.CGROUP_PARENT}/')); "
                                   "print(os.path.exists('/usr/bin/iperf3')); "
                                   f"open('{tmp_path}/from-p0e0', 'w').write('x')").split()
        assert out[0] == "p0e0"
        assert int(out[1]) >= 3  # in the container's cgroups (cpu, memory, ...), not the host's
        assert out[2] == "False"  # the image's file system, not the host's (which has iperf3)
        assert (tmp_path / "from-p0e0").read_text() == "x"  # a share is the host's folder
        # the checkout and the venv are the image's copies (no bind mount), byte for byte
        out = _in(fab, "dpt-d0", "import hashlib, dualpath.naming as f; "
                                 f"print(sum(l.split()[4].startswith('{REPO}') for l in open('/proc/self/mountinfo'))); "
                                 "print(hashlib.sha256(open(f.__file__, 'rb').read()).hexdigest())").split()
        assert out == ["0", hashlib.sha256((REPO / "dualpath" / "naming.py").read_bytes()).hexdigest()]
        cid = containers.docker("inspect", "--format", "{{.Id}}", "dpt-p0e0").strip()
        assert Path(f"/sys/fs/cgroup/cpu{containers.CGROUP_PARENT}/{cid}/cpu.cfs_quota_us").read_text().strip() == "50000"
        assert int(Path(f"/sys/fs/cgroup/memory{containers.CGROUP_PARENT}/{cid}/memory.limit_in_bytes").read_text()) == 1 << 30
        hid = containers.docker("inspect", "--format", "{{.Id}}", "dpt-p0").strip()
        assert Path(f"/sys/fs/cgroup/cpu{containers.CGROUP_PARENT}/{hid}/cpu.shares").read_text().strip() == "512"
        # the containers together weigh what seven processes would in the root cgroup
        assert Path(f"/sys/fs/cgroup/cpu{containers.CGROUP_PARENT}/cpu.shares").read_text().strip() == str(1024 * 7)
        # 2 MB from one node's engine to the other's, through both CNICs' HTB
        src, dst = fab.endpoint("p0e0"), fab.endpoint("d0e0")
        before = _htb_root_bytes(src.nic("cnic").dev, src.name)
        server = subprocess.Popen(fab.exec_argv(dst.name, [sys.executable, "-c", (
            "import socket; s=socket.create_server(('%s', 7711)); c,_=s.accept(); n=0\n"
            "while (b:=c.recv(1<<16)): n+=len(b)\nprint(n)") % dst.ip]), stdout=subprocess.PIPE, text=True)
        try:
            time.sleep(1.5)
            _in(fab, src.name, f"import socket; c=socket.create_connection(('{dst.ip}', 7711), timeout=10); "
                               "c.sendall(bytes(2_000_000)); c.close()")
            assert int(server.communicate(timeout=30)[0]) == 2_000_000
        finally:
            server.kill()
        assert _htb_root_bytes(src.nic("cnic").dev, src.name) - before >= 2_000_000
    left = find_leftovers()
    assert not left.containers and not left.docker_daemon and not left.mounts and not left.cgroups, left


@needs_docker
def test_a_layer_carries_its_files_at_their_own_path(no_leftovers, tmp_path):
    """A project layer built from a small tree: in a container its files are at the tree's own
    path with their bytes, exec bits and links (no bind mount); built once, then cached."""
    tree = tmp_path / "tree"
    (tree / "bin").mkdir(parents=True)
    (tree / "bin" / "run").write_text("#!/bin/sh\necho ran\n")
    (tree / "bin" / "run").chmod(0o755)
    (tree / "data.txt").write_text("payload\n")
    (tree / "bin" / "link").symlink_to("../data.txt")
    files = ["bin/link", "bin/run", "data.txt"]
    seen: list[str] = []
    containers.start_daemon()
    try:
        base = node_image.ensure_base()
        ref = node_image._layer(base, "dpt-node-test", node_image.tree_tag(tree, files, base), tree, files, seen.append)
        assert any("building dpt-node-test:" in s for s in seen)
        seen.clear()
        assert node_image._layer(base, "dpt-node-test", node_image.tree_tag(tree, files, base), tree, files,
                                 seen.append) == ref and seen == []  # cached
        pid = containers.run_container("dpt-t0", ref, [])
        p = subprocess.run(containers.enter_argv(pid, ["sh", "-c", f"cd {tree} && bin/run && cat bin/link && "
                                                       f"readlink bin/link && grep -c ' {tree}' /proc/self/mountinfo"]),
                           capture_output=True, text=True, timeout=60)
        assert p.stdout.split() == ["ran", "payload", "../data.txt", "0"], p.stderr
    finally:
        containers.remove_containers()
        for image_id in containers.docker("images", "--quiet", "dpt-node-test").split():
            containers.docker("rmi", "--force", image_id, check=False)
        containers.stop_daemon()


@needs_docker
def test_a_users_own_docker_daemon_is_left_untouched(no_leftovers):
    """A second dockerd on its own socket and roots, as a user's would be, with DOCKER_HOST
    pointing at it: the testbed's daemon, containers and `dualpath clean` never touch it."""
    containers.start_daemon()  # the Debian layer, saved from ours, is what their daemon runs too
    image = node_image.ensure_base()
    saved = Path(tempfile.mkdtemp(prefix="dpt-image-", dir="/var/tmp")) / "image.tar"
    containers.docker("save", "--output", str(saved), image, timeout=300)
    containers.stop_daemon()
    root = Path(tempfile.mkdtemp(prefix="user-docker-", dir="/tmp"))  # a short socket path
    sock = root / "d.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")}
    (root / "cfg.json").write_text("{}")
    user = subprocess.Popen([containers.DOCKERD, f"--data-root={root}/data", f"--exec-root={root}/exec",
                             f"--host=unix://{sock}", f"--pidfile={root}/pid", f"--config-file={root}/cfg.json",
                             "--storage-driver=vfs", "--bridge=none", "--iptables=false", "--ip6tables=false",
                             "--ip-forward=false", "--ip-masq=false"],
                            stdout=open(root / "log", "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def theirs(*args: str) -> str:
        return subprocess.run([containers.DOCKER, "-H", f"unix://{sock}", *args], capture_output=True, text=True,
                              timeout=120, check=True, env=env).stdout
    try:
        deadline = time.monotonic() + 60
        while subprocess.run([containers.DOCKER, "-H", f"unix://{sock}", "version"], capture_output=True,
                             env=env).returncode != 0:
            assert time.monotonic() < deadline and user.poll() is None, (root / "log").read_text()[-500:]
            time.sleep(0.3)
        theirs("load", "--input", str(saved))
        theirs("run", "-d", "--name", "dpt-users-own", "--network", "none", image, "sleep", "infinity")
        os.environ["DOCKER_HOST"] = f"unix://{sock}"  # what a user's shell would hold
        try:
            containers.start_daemon()
            containers.run_container("dpt-t0", node_image.ensure_base(), [])
            assert user.pid not in find_leftovers().docker_daemon
            clean(verbose=False)  # removes ours: container, daemon, mounts
        finally:
            del os.environ["DOCKER_HOST"]
        assert containers.daemon_pid() is None and not containers.recorded_containers()
        assert user.poll() is None  # their daemon runs on
        assert theirs("inspect", "--format", "{{.State.Running}}", "dpt-users-own").strip() == "true"
    finally:
        user.terminate()
        try:
            user.wait(30)
        except subprocess.TimeoutExpired:
            user.kill()
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):  # their containerd and shims, by their root
            try:
                if str(root).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(int(pid), 9)
            except OSError:
                pass
        subprocess.run(["umount", "-R", "-l", str(root)], capture_output=True)
        for m in [l.split()[1] for l in Path("/proc/self/mounts").read_text().splitlines() if str(root) in l]:
            subprocess.run(["umount", "-l", m], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(saved.parent, ignore_errors=True)
