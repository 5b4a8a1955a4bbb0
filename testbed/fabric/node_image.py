"""The node image of `hosts: docker`, in three layers, each cached under a tag that is a hash
of what it holds, so a layer is rebuilt only when its content changed:

    dpt-node:<script hash>           Debian bookworm from Debian packages alone
                                     (scripts/docker/build-image.sh: debootstrap, docker import)
    dpt-node-venv:<venv hash>        + the project's venv at its own path (1.6 GB; once per venv)
    dpt-node-project:<tree hash>     + the checkout's files at its own path (git's view: tracked and
                                       untracked files, none it ignores; seconds after an edit)

The venv and the checkout keep their paths so that the venv's interpreter links, its scripts'
shebangs and its editable install resolve in a container as they do here. The hash of the venv
is over its path, its pyvenv.cfg, and the names of its installed distributions and .pth files
(a package upgraded or added changes it); the tree's is over every file's path, mode and bytes.

Where the daemon fell back to the vfs storage driver, every container copies its image whole
(1.8 GB each, minutes for seven), so there the image is the Debian layer alone and the checkout
and the venv are bind-mounted read-only instead; `NodeImage.binds` says which, and the progress
line says why.
"""
from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from testbed.fabric import containers
from testbed.fabric.containers import REPO, DockerUnavailableError, docker
from testbed.fabric.shell import CommandError

IMAGE_SCRIPT = REPO / "scripts" / "docker" / "build-image.sh"
VENV_REPO = "dpt-node-venv"
PROJECT_REPO = "dpt-node-project"
KEEP = {VENV_REPO: 2, PROJECT_REPO: 3}  # builds kept per layer: another clone's, the last edits'
BUILD_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class NodeImage:
    """What a node container runs: the image, and the folders it must bind-mount read-only at
    their own paths because the image does not carry them (empty when it carries both)."""

    ref: str
    binds: tuple[Path, ...] = ()


def ensure(progress: Callable[[str], None] = print, venv: Path | None = None) -> NodeImage:
    """The node image, each layer built only if its tag is missing (the daemon must run)."""
    venv = (venv or Path(sys.prefix)).resolve()
    base = ensure_base(progress)
    if docker("info", "--format", "{{.Driver}}").strip() == "vfs":
        progress("[docker image] vfs storage: the checkout and the venv are bind-mounted, not copied "
                 "(vfs copies an image into every container)")
        return NodeImage(base, (REPO,) if venv.is_relative_to(REPO) else (REPO, venv))
    with_venv = _layer(base, VENV_REPO, venv_tag(venv, base), venv, None, progress)
    files = project_files(REPO)
    if files is None:
        progress(f"[docker image] {REPO} is not a git checkout: it is bind-mounted, not copied")
        return NodeImage(with_venv, (REPO,))
    files = [f for f in files if not (REPO / f).is_relative_to(venv)]  # a venv git does not ignore
    return NodeImage(_layer(with_venv, PROJECT_REPO, tree_tag(REPO, files, with_venv), REPO, files, progress))


def ensure_base(progress: Callable[[str], None] = print, timeout_s: float = BUILD_TIMEOUT_S) -> str:
    """The Debian layer's name:tag, built (about a minute, once) only if missing; the build's
    steps go to `progress` as they happen."""
    proc = subprocess.Popen(["bash", str(IMAGE_SCRIPT), str(containers.SOCKET)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(timeout_s, proc.kill)  # debootstrap waits on the mirror
    watchdog.start()
    try:
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("[docker image") and "cached" not in line:
                progress(line.rstrip())
        rc = proc.wait()
    finally:
        watchdog.cancel()
    if rc != 0 or not lines or not lines[-1].startswith("image "):
        raise DockerUnavailableError(f"building the node image failed (exit {rc}): {' | '.join(lines[-3:])[-400:]}")
    return lines[-1].split()[-1]


# -- what a layer holds, and its tag ---------------------------------------------------------------
def project_files(repo: Path) -> list[str] | None:
    """The checkout's files as git sees them (tracked, and untracked ones it does not ignore),
    relative and existing; None if `repo` is not a git work tree."""
    try:
        p = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        return None
    names = sorted({n for n in p.stdout.decode(errors="surrogateescape").split("\0") if n})
    return [n for n in names if os.path.lexists(repo / n)]  # a tracked file deleted in the tree is gone


def tree_tag(root: Path, files: Sequence[str], parent: str) -> str:
    """12 hex digits over the parent image and every file's path, kind, exec bit and bytes."""
    h = hashlib.sha256(parent.encode())
    for name in files:
        p = root / name
        st = p.lstat()
        h.update(b"\0" + name.encode(errors="surrogateescape") + b"\0")
        if stat.S_ISLNK(st.st_mode):
            h.update(b"L" + os.readlink(p).encode(errors="surrogateescape"))
        else:
            h.update(b"X" if st.st_mode & 0o111 else b"F")
            h.update(p.read_bytes())
    return h.hexdigest()[:12]


def venv_tag(venv: Path, parent: str) -> str:
    """12 hex digits over the parent image, the venv's path and pyvenv.cfg, and the names of its
    installed distributions and .pth files with the .pth files' text (an editable install's)."""
    h = hashlib.sha256(f"{parent}\0{venv}\0".encode())
    cfg = venv / "pyvenv.cfg"
    h.update(cfg.read_bytes() if cfg.exists() else b"")
    for site in sorted(venv.glob("lib/python*/site-packages")):
        for entry in sorted(site.iterdir()):
            if entry.name.endswith((".dist-info", ".egg-info", ".pth")):
                h.update(b"\0" + entry.name.encode())
                if entry.suffix == ".pth":
                    h.update(entry.read_bytes())
    return h.hexdigest()[:12]


# -- building a layer ------------------------------------------------------------------------------
def _layer(parent: str, repo: str, tag: str, src: Path, files: Sequence[str] | None,
           progress: Callable[[str], None]) -> str:
    """`repo:tag`: `parent` plus `src`'s files (all of it, or `files` relative to it) at `src`'s
    own path, built by `docker build` from a context streamed by GNU tar (so symlinks stay links);
    older builds of `repo` beyond KEEP are removed."""
    ref = f"{repo}:{tag}"
    if docker("images", "--quiet", ref).strip():
        return ref
    progress(f"[docker image] building {ref}: {parent} + {src}" + (" (once per venv: copies it whole)"
                                                                    if files is None else ""))
    with tempfile.TemporaryDirectory(prefix=f"{containers.PREFIX}-image-") as tmp:
        (Path(tmp) / "Dockerfile").write_text(
            f'FROM {parent}\nCOPY ["payload/", "{src}/"]\nLABEL {containers.PREFIX}.layer="{repo}"\n')
        listing = Path(tmp) / "files"
        listing.write_bytes(b"".join(f"./{f}".encode(errors="surrogateescape") + b"\0" for f in (files or ["."])))
        # members under ./ become payload/... (not symlinks' targets: S); the Dockerfile has no ./
        tar = subprocess.Popen(["tar", "-cf", "-", "-C", tmp, "Dockerfile", "-C", str(src),
                                "--recursion" if files is None else "--no-recursion", "--null", "-T", str(listing),
                                r"--transform=s|^\./|payload/|S"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert tar.stdout is not None and tar.stderr is not None
        failed = None
        try:
            docker("build", "--quiet", "--tag", ref, "-", stdin=tar.stdout, timeout=BUILD_TIMEOUT_S)
        except CommandError as e:  # the daemon's reason (or the timeout); tar then dies of a broken pipe
            failed = str(e)
            tar.kill()
        finally:
            tar.stdout.close()
            tar_err = tar.stderr.read().decode(errors="replace").strip()
            tar.wait(30)
    if failed or tar.returncode:
        raise DockerUnavailableError(f"building {ref} failed: {(failed or tar_err)[-400:]}")
    _prune(repo)
    progress(f"[docker image] built {ref}")
    return ref


def _prune(repo: str) -> None:
    """Remove `repo`'s builds beyond the newest KEEP[repo]. One that a container or a newer
    layer still uses stays (docker refuses; that is fine)."""
    refs = docker("images", "--format", "{{.Repository}}:{{.Tag}}", repo).split()  # newest first
    for old in refs[KEEP.get(repo, 1):]:
        docker("rmi", old, check=False)
